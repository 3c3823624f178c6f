"""A stand-in of the Hugging Face Hub's HTTP API on 127.0.0.1 (tests/test_robustness.py: models by repo id):
what huggingface_hub's snapshot_download asks -- a revision's commit (/api/models/ORG/NAME/revision/REV), its
file tree (/api/models/ORG/NAME/tree/COMMIT) and each file (/ORG/NAME/resolve/COMMIT/FILE) -- with the Hub's
error codes for an unknown repo, a gated one without a token and an unknown revision."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class Hub:
    def __init__(self, repos: dict, gated=(), token="hf_test", cut=()):
        """repos: repo id -> (commit, {file name: bytes}); `gated`: repo ids that need `token`; `cut`: repo ids
        whose weights' download drops half-way.  `log`: the (method, path) of every request."""
        self.repos, self.gated, self.token, self.log, self.cut = repos, set(gated), token, [], set(cut)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body=b"", headers=None, head=False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status, code, head=False):
                self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                                          "Content-Type": "application/json"}, head)

            def _repo(self, repo_id, rev, head=False):
                """(sha, files) of repo_id at rev ("main" or its sha), else None with the Hub's error sent."""
                if repo_id not in hub.repos:
                    self._error(401, "RepoNotFound", head)
                    return None
                if repo_id in hub.gated and self.headers.get("authorization") != f"Bearer {hub.token}":
                    self._error(401, "GatedRepo", head)
                    return None
                if rev not in ("main", hub.repos[repo_id][0]):
                    self._error(404, "RevisionNotFound", head)
                    return None
                return hub.repos[repo_id]

            def handle_one(self, head):
                path = unquote(urlparse(self.path).path)
                hub.log.append((self.command, path))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    # /api/models/ORG/NAME/revision/REV
                    repo_id, rev = "/".join(parts[2:4]), parts[5] if len(parts) > 5 else "main"
                    repo = self._repo(repo_id, rev, head)
                    if repo is None:
                        return
                    sha, files = repo
                    if len(parts) > 4 and parts[4] == "tree":
                        body = [{"type": "file", "path": f, "size": len(d),
                                 "oid": hashlib.sha1(b"blob %d\0" % len(d) + d).hexdigest()} for f, d in files.items()]
                        return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                    body = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                            "siblings": [{"rfilename": f} for f in files]}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    repo = self._repo(repo_id, rev, head)
                    if repo is None:
                        return
                    sha, files = repo
                    if name not in files:
                        return self._error(404, "EntryNotFound", head)
                    data = files[name]
                    etag = '"' + hashlib.sha256(data).hexdigest() + '"'
                    if repo_id in hub.cut and not head and name.endswith(".safetensors"):  # the connection drops
                        self.send_response(200)
                        for k, v in {"X-Repo-Commit": sha, "ETag": etag, "Content-Length": str(len(data))}.items():
                            self.send_header(k, v)
                        self.end_headers()
                        self.wfile.write(data[:len(data) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    return self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag,
                                                  "Content-Type": "application/octet-stream"}, head)
                self._error(404, "NotFound", head)

            def do_GET(self):
                self.handle_one(False)

            def do_HEAD(self):
                self.handle_one(True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
