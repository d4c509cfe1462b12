import os
from pathlib import Path

import pytest

# Set before torch, Prefect, DVC or MLflow are imported by any test module.
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault(
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"
)  # a busy 2-core machine needs more than 20 s
_shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "alfworld" / "json_2.1.1_all_splits.tar.xz"
if _shared.exists():
    os.environ.setdefault("QEVOLVE_ALFWORLD_ARCHIVE", str(_shared))

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def alfworld_data() -> Path:
    from qevolve.envs.alfworld import ensure_alfworld_data

    return ensure_alfworld_data()


CORPUS = [
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a desk 1, and a shelf 2.",
    "Your task is to: put some book on sidetable.",
    "Action: go to cabinet 1",
    "Action: open cabinet 1",
    "Action: take book 1 from desk 1",
    "You arrive at desk 1. On the desk 1, you see a book 1 and a pen 2.",
    "Nothing happens.",
] * 20


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A 2-layer Qwen2 model and a BPE tokenizer trained on a few lines of ALFWorld text."""
    from qevolve.config import EmbeddedModelConfig
    from qevolve.models.base import build_embedded

    out = tmp_path_factory.mktemp("base")
    cfg = EmbeddedModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=400)
    build_embedded(cfg, CORPUS, out, max_positions=1024)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_base)


class FakeChat:
    """A local OpenAI-compatible server (`POST /v1/chat/completions`): `answer(body) -> str` makes each reply;
    `requests` keeps the bodies it got."""

    def __init__(self, answer):
        import json
        from http.server import BaseHTTPRequestHandler, HTTPServer

        fake = self
        self.answer, self.requests = answer, []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                data = json.dumps({"choices": [{"message": {"content": fake.answer(body)}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"


@pytest.fixture
def fake_chat():
    """`fake_chat(answer)`: a started `FakeChat`, stopped after the test."""
    import threading

    servers = []

    def start(answer):
        servers.append(FakeChat(answer))
        threading.Thread(target=servers[-1].server.serve_forever, daemon=True).start()
        return servers[-1]

    yield start
    for s in servers:
        s.server.shutdown()
        s.server.server_close()
