"""Solutions to notebook 15's exercises."""


def conversations_that_fit(num_blocks, block_size, system_len, conversation_len):
    shared = system_len // block_size  # full blocks only: stored once, shared by everyone
    own = -(-conversation_len // block_size) - shared  # the rest, in whole blocks, per conversation
    if num_blocks < shared + own:
        return 0
    return (num_blocks - shared) // own


def prefix_hit_tokens(shared_len, prompt_lens, block_size):
    return sum(min(shared_len // block_size, (n - 1) // block_size) * block_size for n in prompt_lens[1:])
