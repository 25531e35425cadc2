"""Solutions to notebook 15's exercises."""


def kv_bytes_per_token(config):
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4


def prefix_hit_tokens(shared_len, prompt_lens, block_size):
    return sum(min(shared_len // block_size, (n - 1) // block_size) * block_size for n in prompt_lens[1:])
