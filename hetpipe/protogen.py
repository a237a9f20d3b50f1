"""Regenerates the checked-in gRPC stubs in hetpipe/v1 from protos/ (`make proto`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Runs protoc over every .proto; returns the files it wrote."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p.relative_to(PROTO_DIR)) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / "hetpipe" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
