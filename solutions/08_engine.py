"""Solutions to notebook 08's exercises."""


def slot_of(table, t, block_size):
    return table[t // block_size] * block_size + t % block_size


def run_to_completion(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    texts = {rid: "" for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.delta_text
    return texts
