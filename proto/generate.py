"""Regenerate the committed Python code from proto/kvtier.proto (``make proto``).

Generated into the ``proto`` package so the stubs import ``from proto import kvtier_pb2``.
``tests/format/test_proto.py`` regenerates into a temporary directory and fails when the
committed files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "proto/kvtier.proto"
GENERATED = ("kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    include = Path(protoc.__file__).parent / "_proto"
    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(ROOT / PROTO),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [out_root / "proto" / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    sys.exit(0)
