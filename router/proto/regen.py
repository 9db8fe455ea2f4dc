"""Regenerate v4serve_pb2.py / v4serve_pb2_grpc.py from v4serve.proto (needs grpcio-tools).

Run from anywhere: `python router/proto/regen.py`. The modules are committed so that serving
needs only the runtime packages (grpcio, protobuf), not the compiler.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
                      f"--grpc_python_out={ROOT}", str(ROOT / "router/proto/v4serve.proto")])
    sys.exit(rc)
