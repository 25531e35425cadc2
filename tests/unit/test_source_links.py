"""Every source path a notebook's "where this lives" section cites links to that file in the pinned release
(tools/link_sources.py), so a reader lands on the code the text describes, not on today's ``main``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("link_sources", REPO / "tools" / "link_sources.py")
links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(links)


def test_every_cited_path_in_the_notebooks_is_linked_to_its_pinned_release():
    plain = [f"{p.name}: {x}" for p in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py"))
             for x in links.plain_paths(p.read_text())]
    assert not plain, "unlinked source paths (run tools/link_sources.py notebooks/*.py):\n" + "\n".join(plain)
    text = "\n".join(p.read_text() for p in (REPO / "notebooks").glob("[0-9][0-9]_*.py"))
    urls = re.findall(r"\]\((https://github\.com/[^)]+)\)", text)
    assert len(urls) > 100
    for u in urls:
        if "vllm-project/vllm/" in u:
            assert "/v0.11.0/" in u, u
        if "sgl-project/sglang/" in u:
            assert "/v0.5.3/" in u, u


def test_a_plain_path_is_reported_then_linked_once():
    text = "# ## Where this lives in vLLM / SGLang\n#\n# | `vllm/v1/core/block_pool.py` | `python/sglang/srt/x.py` |\n"
    assert links.plain_paths(text) == ["vllm/v1/core/block_pool.py", "python/sglang/srt/x.py"]
    linked, kept = links.link(text)
    assert "[`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/" \
           "block_pool.py)" in linked and kept == []
    assert links.link(linked)[0] == linked and links.plain_paths(linked) == []


def test_paths_outside_the_section_or_after_the_release_stay_plain():
    text = ("# ## Build it small\n# `vllm/v1/core/block_pool.py`\n# ## Where it lives\n"
            "# `vllm/v1/spec_decode/draft_model.py` (added after v0.11.0)\n# ## Summary\n# `vllm/outputs.py`\n")
    linked, kept = links.link(text)
    assert linked == text and kept == ["vllm/v1/spec_decode/draft_model.py"]


def test_a_vllm_kernel_path_links_to_the_vllm_release():
    text = "# ## Where this lives in vLLM / SGLang\n# > * `csrc/attention/paged_attention_v1.cu` — the CUDA kernel\n"
    linked, _ = links.link(text)
    assert "](https://github.com/vllm-project/vllm/blob/v0.11.0/csrc/attention/paged_attention_v1.cu)" in linked


def test_a_transformers_path_links_to_the_release_the_realmodel_tier_pins():
    text = "# ## Where it lives in vLLM and SGLang\n# * transformers `src/transformers/modeling_gguf_pytorch_utils.py`\n"
    linked, _ = links.link(text)
    pinned = re.search(r'"transformers==([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert ("](https://github.com/huggingface/transformers/blob/v" + pinned
            + "/src/transformers/modeling_gguf_pytorch_utils.py)") in linked
    notebook = (REPO / "notebooks" / "15_real_model.py").read_text()
    assert "transformers/blob/v" + pinned + "/src/transformers/modeling_gguf_pytorch_utils.py" in notebook
