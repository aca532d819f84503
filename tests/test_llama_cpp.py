"""llama.cpp beside kvbudget in ``kvbudget bench serve``: the KV sizing, the command line, the stream
parser and the rows, without the ``llama-server`` build (``make llama``, about 40 minutes here; the
bench itself is in docs/serving.md with its command). A stand-in server speaking llama-server's
protocol (``/health``, ``/slots``, streamed ``/completion``) drives the client loop end to end."""

from __future__ import annotations

import json
import sys
import textwrap
from types import SimpleNamespace

import pytest

from kvbudget.bench.serve_load import llama_row
from kvbudget.errors import InputError
from kvbudget.peer import llama_cpp

QWEN_05B = SimpleNamespace(
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896, head_dim=64
)


def test_token_bytes_by_hand() -> None:
    # 24 layers x 2 KV heads x 64 channels x (keys + values) = 6,144 elements a token
    assert llama_cpp.token_bytes(QWEN_05B, "f16") == 6144 * 2
    assert llama_cpp.token_bytes(QWEN_05B, "q8_0") == 6144 / 32 * 34  # 32 int8 codes + an f16 scale
    assert llama_cpp.token_bytes(QWEN_05B, "q4_0") == 6144 / 32 * 18  # 32 4-bit codes + an f16 scale
    no_head_dim = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=256)
    assert llama_cpp.token_bytes(no_head_dim, "f16") == 2 * 4 * 64 * 2 * 2


def test_slots_are_what_the_cap_holds() -> None:
    per_token = llama_cpp.token_bytes(QWEN_05B, "q4_0")
    longest = 8192 + 64
    cap = int(8448 * 3 * per_token) + 1
    plan = llama_cpp.plan_slots(cap, longest, per_token, clients=9, cache_type="q4_0")
    # 3 x 8,256 = 24,768 tokens, padded to 24,832 (97 x 256): within the cap; 4 slots are not
    assert (plan.slots, plan.ctx, plan.slot_tokens) == (3, 24832, 8277)
    assert plan.kv_bytes == int(24832 * per_token) <= cap
    assert plan.slot_tokens >= longest
    assert llama_cpp.plan_slots(10**12, 100, per_token, clients=4, cache_type="q4_0").slots == 4
    with pytest.raises(InputError, match="holds no 100-token conversation"):
        llama_cpp.plan_slots(1000, 100, per_token, clients=4, cache_type="q4_0")


def test_the_command_line_sets_the_plan() -> None:
    plan = llama_cpp.SlotPlan("q8_0", 3, 1536, 1)
    command = llama_cpp.server_command("bin/llama-server", "m.gguf", 8123, plan, threads=2)

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert command[0] == "bin/llama-server" and flag("--model") == "m.gguf"
    assert flag("--ctx-size") == "1536" and flag("--parallel") == "3" and flag("--port") == "8123"
    assert flag("--cache-type-k") == flag("--cache-type-v") == "q8_0" and flag("--flash-attn") == "on"
    assert flag("--host") == "127.0.0.1" and flag("--cache-ram") == "0" and "--no-kv-unified" in command


def test_bad_binary_and_cache_types_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(InputError, match="make llama"):
        llama_cpp.check_binary(tmp_path / "llama-server")
    with pytest.raises(InputError, match="takes f16, q8_0, q4_0; got q5_1"):
        llama_cpp.check_cache_types(["q5_1"])
    assert llama_cpp.check_cache_types(["q4_0", "f16"]) == ["q4_0", "f16"]


def _events(*events: dict) -> list[bytes]:
    return [f"data: {json.dumps(e)}\n".encode() for e in events] + [b"\n"]


def test_the_stream_parser_times_tokens_as_they_arrive() -> None:
    clock = iter([1.5, 2.0, 3.0]).__next__  # the times the three token events arrive
    lines = _events(
        {"content": " 12", "tokens": [220, 16], "stop": False},
        {"content": "34", "tokens": [1958], "stop": False},
        {"content": "", "tokens": [], "stop": False, "prompt_progress": {"processed": 10}},
        {"content": ".", "tokens": [13], "stop": False},
        {"content": "", "tokens": [], "stop": True, "tokens_predicted": 4},
    )
    out = llama_cpp.parse_stream(lines, start=0.5, clock=clock)
    assert out["text"] == " 1234." and out["token_ids"] == [220, 16, 1958, 13]
    assert out["ttft_s"] == 1.0 and out["tpot_s"] == pytest.approx((3.0 - 1.5) / 3)
    error = llama_cpp.parse_stream(_events({"error": {"message": "context full"}}), 0.0, lambda: 0.0)
    assert error == {"error": "context full"}


def test_the_row_scores_answers_and_counts_failures() -> None:
    plan = llama_cpp.SlotPlan("q4_0", 2, 1024, 4096)
    run = {"wall_s": 10.0, "held_at_once": 2, "requests": [
        {"id": 0, "text": " 12", "token_ids": [1, 2], "ttft_s": 1.0, "tpot_s": 0.5},
        {"id": 1, "text": " 7", "token_ids": [3], "ttft_s": 3.0, "tpot_s": None},
        {"id": 2, "error": "HTTP 500: boom"},
    ]}  # fmt: skip
    answers = {0: ["12"], 1: ["8"], 2: ["9"]}
    row = llama_row(
        run, plan, 5000, answers, lambda text, ans: float(text.strip() in ans), "b1 (abc), m.gguf", 2
    )
    assert row["compression"] == "llama.cpp (q4_0)" and row["answered"] == 2
    assert row["errors"] == ["HTTP 500: boom"] and row["accuracy"] == 0.5
    assert row["tokens"] == 3 and row["tokens_per_s"] == pytest.approx(0.3)
    assert row["held_at_once"] == 2 and row["peak_kv_bytes"] == 4096 and row["cap_bytes"] == 5000
    assert row["ttft_p50_s"] in (1.0, 3.0) and row["tpot_p50_s"] == 0.5
    assert "2 slots of 512 tokens" in row["note"] and "m.gguf" in row["note"]


#: A stand-in for llama-server: its health, slots and streamed completion endpoints, answering each
#: prompt with its own length's digits one token a time (two slots, counted busy while streaming).
FAKE_SERVER = """
    import json, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    slots = int(args[args.index("--parallel") + 1])
    busy, lock = [0], threading.Lock()
    gate = threading.Semaphore(slots)
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def _json(self, body):
            data = json.dumps(body).encode()
            self.send_response(200); self.send_header("content-length", str(len(data))); self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health": return self._json({"status": "ok"})
            with lock: n = busy[0]
            self._json([{"id": i, "is_processing": i < n} for i in range(slots)])
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with gate:
                with lock: busy[0] += 1
                self.send_response(200); self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for ch in str(len(body["prompt"]))[: body["n_predict"]]:
                    time.sleep(0.3)
                    event = {"content": ch, "tokens": [int(ch)], "stop": False}
                    self.wfile.write(("data: " + json.dumps(event) + "\\n\\n").encode()); self.wfile.flush()
                self.wfile.write(b'data: {"content": "", "tokens": [], "stop": true}\\n\\n')
                with lock: busy[0] -= 1
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_the_client_loop_against_a_server_speaking_llama_servers_protocol(tmp_path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER))
    binary.chmod(0o755)
    prompts = [
        {"id": i, "input_ids": [7] * (10 + i), "max_new_tokens": 8, "ignore_eos": False} for i in range(5)
    ]
    plan = llama_cpp.SlotPlan("q8_0", 2, 512, 1)
    run = llama_cpp.run_server(
        llama_cpp.check_binary(binary), tmp_path / "m.gguf", plan, prompts, clients=4, threads=1,
        log=tmp_path / "llama.log", timeout_s=60,
    )  # fmt: skip
    by_id = {r["id"]: r for r in run["requests"]}
    assert sorted(by_id) == list(range(5))
    for i, r in by_id.items():
        assert r["text"] == str(10 + i) and r["token_ids"] == [int(c) for c in str(10 + i)]
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0
    assert run["held_at_once"] == 2  # four clients, two slots
    assert run["wall_s"] > 0


def test_a_request_that_waits_past_its_timeout_is_an_error_not_lost(tmp_path) -> None:
    """A request queued behind busy slots longer than the client waits: an error row of its own."""
    import socket
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        held: list = []

        def accept_and_wait() -> None:  # accepts, reads the request, never answers
            conn, _ = server.accept()
            held.append(conn)
            conn.recv(1 << 16)

        threading.Thread(target=accept_and_wait, daemon=True).start()
        out = llama_cpp._post_stream(port, {"prompt": [1]}, timeout=0.5)
    assert out == {"error": out["error"]} and "timed out" in out["error"]
