"""Schemathesis against `specwise serve`'s own OpenAPI document, on loopback with a tiny model (issue 21): a few
hundred generated requests (valid and invalid, every route, the admin API with its key), 0 answers 5xx, and the
server healthy afterwards."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import httpx
from test_server import serve_process

ST = shutil.which("st", path=str(__import__("pathlib").Path(sys.executable).parent))


def _schemathesis(url: str, doc, key: str, include: str, report) -> tuple[subprocess.CompletedProcess, int]:
    cmd = [ST or "st", "run", str(doc), "--url", url, "-H", f"Authorization: Bearer {key}"]
    cmd += ["--checks", "not_a_server_error", "--max-examples", "8", "--seed", "21", "--generation-database", "none"]
    cmd += ["--include-path-regex", include, "--request-timeout", "60", "--no-color"]
    cmd += ["--report", "junit", "--report-junit-path", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=report.parent)
    found = re.search(r"(\d+) generated", proc.stdout)
    return proc, int(found.group(1)) if found else 0


def test_schemathesis_finds_no_5xx_and_the_server_stays_healthy(tiny_dir, tmp_path):
    assert ST is not None, "schemathesis is a dev dependency (pip install -e .[dev])"
    args = ("--model", tiny_dir, "--drafter", "ngram", "--drafters", "suffix", "--max-len", "512")
    with serve_process(*args, "--api-key", "client-key", "--admin-key", "admin-key") as url:
        doc = tmp_path / "openapi.json"  # the document is behind the client key, the admin routes take their own
        doc.write_bytes(httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer client-key"}).content)
        api, n_api = _schemathesis(url, doc, "client-key", "^/(v1|health|metrics)", tmp_path / "api.xml")
        admin, n_admin = _schemathesis(url, doc, "admin-key", "^/admin", tmp_path / "admin.xml")
        for proc in (api, admin):
            assert proc.returncode == 0, proc.stdout[-4000:]
        print(f"schemathesis: {n_api} + {n_admin} generated requests")
        assert n_api + n_admin >= 200, (n_api, n_admin)  # it really generated a few hundred requests
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        ok = httpx.post(
            url + "/v1/completions",
            json={"prompt": "abc", "max_tokens": 4},
            headers={"Authorization": "Bearer client-key"},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
