"""Solutions to notebook 07's exercises."""


def fewest_computed(candidates):
    # min() keeps the first of equals; scanning newest first makes that the most recently admitted
    return min(reversed(candidates), key=lambda c: c.num_computed_tokens)


def plan_step(needs, budget):
    decodes_left = sum(1 for n in needs if n == 1)  # reserved first: decodes never stall
    plan = []
    for need in needs:
        if need == 1:
            decodes_left -= 1
            n = 1
        else:
            n = max(0, min(need, budget - decodes_left))  # a prefill chunk: what is left after the decodes
        budget -= n
        plan.append(n)
    return plan
