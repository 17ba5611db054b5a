"""Issue 'field-proven guard' through the real daemon: a tuned host does not loop; a webhook gets a stop."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from conftest import REPO
from sparkdproc import db_query, sparkd_run, wait_for

WATERMARK_PROC = REPO / "tests" / "fixtures" / "proc-watermark"


def test_a_tuned_host_below_the_floor_warns_and_does_not_loop(tmp_path: Path) -> None:
    db = tmp_path / "sparkd.db"
    cfg = f'proc_root = "{WATERMARK_PROC}"\ninterval_s = 0.1\nfast_interval_s = 0.1\nkernlog_source = "off"\n'
    with sparkd_run(tmp_path, config=cfg):
        warn = wait_for(lambda: db_query(db, "SELECT message FROM events WHERE kind='watermark' ORDER BY id"), 5)
        assert warn, "no watermark warning at start"
        assert "low_available cannot protect this host" in warn[0][0]
        # the default floor is usable < 6 GiB; on the MemAvailable scale that is 6 GiB + this host's CmaFree
        assert "healthy MemAvailable 1.60 GiB" in warn[0][0] and "floor 6.12 GiB" in warn[0][0]
        # the rule holds its 4 s and trips once; the loop guard demotes it instead of stopping
        demoted = wait_for(
            lambda: db_query(
                db, "SELECT message FROM events WHERE kind='watermark' AND message LIKE '%demoted to warn%'"
            ),
            10,
        )
        assert demoted and "(trip 1)" in demoted[0][0]
        time.sleep(2.0)  # 20 more samples below the floor
        trips = db_query(db, "SELECT count(*) FROM events WHERE kind='trip'")[0][0]
        stops = db_query(db, "SELECT count(*) FROM events WHERE kind IN ('stop_not_executed','stopping')")[0][0]
        assert trips >= 1 and stops == 0
        # each trip the loop guard demoted says it stopped nothing (not a critical trip that reads as a stop):
        # low_available's, and repeated_dips' (usable 1.5 GiB < 3 GiB: it holds its 3 s first, and loops as well)
        rows = db_query(db, "SELECT message, severity, details FROM events WHERE kind='trip'")
        tripped = set()
        for msg, severity, details in rows:
            rule = msg.split(":", 1)[0]
            tripped.add(rule)
            assert f"NOT stopped: {rule} is demoted to warn" in msg and severity == "warning", (msg, severity)
            assert "demoted" in json.loads(details)
        assert tripped >= {"low_available", "repeated_dips"}, rows

        # the stored snapshot (what `sparkd status` reads) lags a quiet refresh by up to STATUS_QUIET_S plus the
        # writer's 5 s gathering (a change is written at once): wait for the one written after the demotion
        def demoted_status() -> dict[str, Any] | None:
            st = json.loads(db_query(db, "SELECT data FROM status")[0][0])
            r = next(r for r in st["rules"] if r["name"] == "low_available")
            return st if r["demoted"] else None

        status = wait_for(demoted_status, 15)
        assert status is not None, "the stored status never showed the demotion"
        rule = next(r for r in status["rules"] if r["name"] == "low_available")
        assert rule["demoted"] and rule["action"] == "warn"
        assert status["watermark"]["warnings"]


class _Receiver(http.server.BaseHTTPRequestHandler):
    got: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).got.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return None


def test_a_webhook_receives_the_trip_json_and_a_command_hook_gets_the_fields(tmp_path: Path) -> None:
    receiver = type("R", (_Receiver,), {"got": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "hook.json"
    hook = [
        "python3",
        "-c",
        "import os,json,sys; open(sys.argv[1],'w').write(json.dumps({k: v for k, v in "
        "os.environ.items() if k.startswith('SPARKD_EVENT')}))",
        str(out),
    ]
    cfg = (
        'interval_s = 0.1\nfast_interval_s = 0.1\nkernlog_source = "off"\ncooldown_s = 3600\n'
        '[[rules]]\nname = "always"\nwhen = ["MemAvailable > 0B"]\nsamples = 3\n'
        f'[notify]\nwebhook_url = "http://127.0.0.1:{server.server_address[1]}/hook"\nkinds = ["trip"]\n'
        f"command = {json.dumps(hook)}\n"
    )
    try:
        with sparkd_run(tmp_path, config=cfg):
            assert wait_for(lambda: receiver.got, 10), "webhook got nothing"
            ev = receiver.got[0]
            assert ev["kind"] == "trip" and ev["message"].startswith("always: MemAvailable ")
            assert wait_for(out.exists, 10)
            fields = json.loads(out.read_text())
            assert fields["SPARKD_EVENT_KIND"] == "trip"
            assert fields["SPARKD_EVENT_MESSAGE"].startswith("always: MemAvailable ")
    finally:
        server.shutdown()
