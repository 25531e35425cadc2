"""Solutions to notebook 08's exercises."""


def latency_in_steps(arrivals, step_outputs):
    first, done = {}, {}
    for step, outputs in enumerate(step_outputs, start=1):  # the first step() call is step 1
        for out in outputs:  # a step returns outputs only for requests that got a token in it
            first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = step
    return {rid: (first[rid] - arrived, done[rid] - arrived) for rid, arrived in arrivals.items()}


def run_to_completion(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    texts = {rid: "" for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.delta_text
    return texts
