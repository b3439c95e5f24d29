"""A tiny OpenAI-style server for the proxy's tests (the "custom" engine): stdlib only, real HTTP.

    python fake_engine.py --host H --port P --name NAME [--gate DIR]

GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions. A streamed answer sends its
first chunk at once; with --gate it sends the rest only once DIR/go exists (the test says when). Every
answer names the replica (served_by) and the model the request asked for; a non-streamed one says it used 3
completion tokens, a streamed one sends no usage (two chunks). The prompt "<page>" gets an HTML page with a script
(a hostile engine).
"""

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--gate", default="")
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def _json(self, status, data):
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {"status": "ok"})
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [{"id": args.name, "object": "model"}]})
            return self._json(404, {"error": "not found"})

        def do_POST(self):
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._json(404, {"error": "not found"})
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            print("request", self.path, json.dumps(req)[:200], flush=True)
            base = {"model": req.get("model"), "served_by": args.name}
            if req.get("prompt") == "<page>":  # a hostile engine: an HTML page with a script
                body = b"<html><script>alert(1)</script></html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            if not req.get("stream"):
                choices = [{"index": 0, "text": "hello"}]
                usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
                return self._json(200, {**base, "object": "text_completion", "choices": choices, "usage": usage})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self._event({**base, "choices": [{"index": 0, "text": "first"}]})
            if args.gate:
                go = os.path.join(args.gate, "go")
                deadline = time.time() + 30
                while not os.path.exists(go) and time.time() < deadline:
                    time.sleep(0.02)
            self._event({**base, "choices": [{"index": 0, "text": "second"}]})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, data):
            self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            self.wfile.flush()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print("listening", args.host, args.port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
