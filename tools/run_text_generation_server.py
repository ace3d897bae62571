"""Serve text generation over HTTP (Megatron-LM's PUT /api JSON interface, and a page at /)
from a checkpoint.

    [torchrun --nproc_per_node TP*PP] tools/run_text_generation_server.py --load DIR \
        --vocab-file F --merge-file F [--tensor-model-parallel-size N --pipeline-model-parallel-size M] \
        [--host 0.0.0.0] [--port 5000] [--max-batch-size 64] [--max-request-bytes 1048576]

    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["def main("], "tokens_to_generate": 32, "top_p": 0.9}'

Open http://HOST:PORT/ in a browser to type a prompt and see its completion. Rank 0 serves HTTP
and broadcasts each request to the other ranks. --port 0 picks a free port; the address served
is printed on stderr ("serving on http://HOST:PORT/api"). See docs/inference.md.
"""
import os
import signal
import sys
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config  # noqa: E402
from app.config.inference import InferenceLoadConfig  # noqa: E402
from app.config.options import option  # noqa: E402


@dataclass(kw_only=True)
class ServerOptions:
    """tools/run_text_generation_server.py's command line: the checkpoint and the HTTP server."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("server", "the address and the request limits")

    checkpoint: InferenceLoadConfig
    host: str = option("--host", default="0.0.0.0")
    port: int = option("--port", default=5000)
    max_batch_size: int = option("--max-batch-size", default=64,
                                 help="most prompts (and beams) in one request")
    max_request_bytes: int = option("--max-request-bytes", default=1 << 20,
                                    help="largest request body; larger ones get 413")

    def __post_init__(self) -> None:
        for flag, value in (("--max-batch-size", self.max_batch_size),
                            ("--max-request-bytes", self.max_request_bytes)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


def get_options(argv: Optional[List[str]] = None) -> ServerOptions:
    """ServerOptions from the command line (exit status 2 on a bad one)."""
    return parse_config(ServerOptions, argv, __doc__.split("\n")[0])


def main(argv: Optional[List[str]] = None) -> int:
    from app.inference.session import configure_tool_logging, open_session
    configure_tool_logging("server")
    a = get_options(argv)
    from app.inference.server import create_app
    from app.checkpoint import CheckpointError
    try:
        session = open_session(a.checkpoint)
    except (ValueError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not session.is_leader:
        session.follow()
        session.close()
        return 0
    from werkzeug.serving import make_server
    app = create_app(session, a.max_batch_size, a.max_request_bytes)
    server = make_server(a.host, a.port, app, threaded=True)
    print(f"serving on http://{a.host}:{server.server_port}/api (page: "
          f"http://{a.host}:{server.server_port}/)", file=sys.stderr, flush=True)
    def _terminate(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _terminate)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        session.stop()
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
