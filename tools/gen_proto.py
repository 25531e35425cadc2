"""Generate minienv's gRPC Python code from ``proto/minienv/v1/minienv.proto`` into ``minienv/serving/``.

    python tools/gen_proto.py            # rewrite minienv/serving/minienv_pb2{,_grpc}.py and minienv_pb2.pyi
    python tools/gen_proto.py --out DIR  # write them to DIR instead (the test compares DIR with the committed files)

Why a tool: the generated files are committed (so ``pip install minienv[serve]`` needs no protoc), and this is the
one way they are written. protoc names the module after the proto's path (``minienv.v1``); the stubs live in
``minienv.serving``, so the one import of the ``_grpc`` module is rewritten. The proto keeps its full path
(``minienv/v1/minienv.proto``) inside the descriptor, which is what server reflection shows a client.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO = "minienv/v1/minienv.proto"
OUT = REPO / "minienv" / "serving"
FILES = ("minienv_pb2.py", "minienv_pb2.pyi", "minienv_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc on the proto; write :data:`FILES` into ``out_dir``; return their paths."""
    from grpc_tools import protoc  # the serve extra
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"  # the well-known types
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                          f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
        made = Path(tmp) / Path(PROTO).parent
        grpc_file = made / "minienv_pb2_grpc.py"
        text = grpc_file.read_text()
        old = "from minienv.v1 import minienv_pb2 as"
        if old not in text:
            raise RuntimeError(f"protoc's output changed shape: {old!r} not found in {grpc_file.name}")
        grpc_file.write_text(text.replace(old, "from minienv.serving import minienv_pb2 as"))
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in FILES:
            shutil.copyfile(made / name, out_dir / name)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help=f"output directory (default: {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
