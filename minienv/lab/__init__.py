"""Teaching exhibits: experiments, simulations and the naive design, kept apart from the engine.

What lives here (the notebooks import it; nothing here is needed to *serve*):

* :mod:`minienv.lab.naive_design` — the naive design as it circulates in tutorials, reproduced **broken on
  purpose** so the notebooks can show each failure beside the real KV cache manager;
* :mod:`minienv.lab.workload` — seeded synthetic request-length workloads (ShareGPT-like, Alpaca-like);
* :mod:`minienv.lab.memory_accounting` — where KV memory goes under contiguous vs paged allocation (vLLM Fig. 2);
* :mod:`minienv.lab.serving` — the demo model and a greedy serving helper that drives the real engine;
* :mod:`minienv.lab.sharing_experiments` — the vLLM paper's sharing results recomputed with the real manager;
* :mod:`minienv.lab.sharing_demos` — notebook 05's scripted scenes (arrivals around a shared prefix, a fork with
  copy-on-write) and its trap re-checks, on the real manager;
* :mod:`minienv.lab.scheduling_demos` — notebook 07's bench: a tiny seeded model, a mixed workload, and readers
  of what the engine recorded (step budgets, preemptions and resumes);
* :mod:`minienv.lab.eviction_experiments` — prefix-cache hit rate vs KV budget, and a step-by-step cache stream;
* :mod:`minienv.lab.block_size` — the block-size sweep (1 … 256) on three traces through the real scheduler and
  manager, the dynamic scheme against the best fixed size, and ``recommend_block_size``.

Layering rule: the engine path (``minienv.tokenizer``, ``minienv.model``, ``minienv.kv``, ``minienv.scheduler``,
``minienv.engine``, ``minienv.request``, ``minienv.sampling``, ``minienv.cli``) never imports ``minienv.lab`` or
``minienv.viz``. ``minienv.lab`` may import the engine path (and drives it rather than copying it); the broken
classes of the naive design are importable only from ``minienv.lab.naive_design``.
"""
