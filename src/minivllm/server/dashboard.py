"""The dashboard at /dashboard: a static page of the package (dashboard/index.html and
app.js: no build step, nothing fetched from elsewhere) that reads the server's own API.

Its live numbers come from GET /dashboard/api/engine: the snapshot the engine publishes
to the frontend after every step anyway (engine_core.EngineCore.snapshot), so polling the
page costs the engine nothing; only the HTTP side works. The benchmarks tab renders
bench/results/report/report.md (`python -m bench report`'s tables and charts). Its step timeline comes from
GET /dashboard/api/steps: the engine's last steps (LLMEngine.step_history, a tuple
appended per step), fetched between two steps. The page and its script are open
(they hold no data); the data endpoints are behind --api-key like the API (the page sends
the key typed into it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from starlette.responses import FileResponse, HTMLResponse, Response

PAGE_DIR = Path(__file__).resolve().parent / "dashboard"
OPEN_PATHS = ("/dashboard", "/dashboard/app.js")
OPEN_PREFIX = "/dashboard/report/"  # the report's charts (images: the page cannot send a key)
_RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"  # a source checkout


def benchmark_rows(results: Path = _RESULTS, most: int = 40) -> dict:
    """The committed results folders, newest first: date, machine and what was measured
    (their names: DATE-MACHINE-WHAT), and their data files."""
    if not results.is_dir():
        return {"note": "No bench/results here (the benchmarks live in a source checkout).",
                "rows": []}
    rows = []
    for d in sorted((p for p in results.iterdir() if p.is_dir()), reverse=True)[:most]:
        m = re.match(r"(\d{4}-\d{2}-\d{2})-([a-z0-9]+)-(.*)", d.name)
        date, machine, what = m.groups() if m else ("", "", d.name)
        rows.append({"date": date, "machine": machine, "what": what.replace("-", " "),
                     "json files": len(list(d.glob("*.json")))})
    report = results / "report" / "report.md"
    return {"note": f"The newest {len(rows)} results folders of bench/results "
                    "(their README.md says what each measured).", "rows": rows,
            "report": report.read_text() if report.is_file() else None}


def add_dashboard(app, engine) -> None:
    page = (PAGE_DIR / "index.html").read_text()
    script = (PAGE_DIR / "app.js").read_text()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(page)

    @app.get("/dashboard/app.js", include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript")

    @app.get("/dashboard/api/engine", include_in_schema=False)
    async def engine_numbers():
        snapshot = dict(await engine.refresh_snapshot())
        snapshot.pop("engines", None)
        snapshot.setdefault("time", time.monotonic())
        return {**snapshot, "model": str(engine.model_path), "max_model_len":
                engine.max_model_len, "running": engine.is_running}

    @app.get("/dashboard/api/steps", include_in_schema=False)
    async def steps():
        """The engine's last steps (asked between two steps: one round trip)."""
        from ..engine.llm_engine import recent_steps
        target = getattr(engine, "replicas", [engine])[0]  # data parallel: the first
        rows = await target.call(recent_steps) if target.is_running else []
        return {"fields": ["time", "path", "tokens", "sequences", "seconds"], "steps": rows}

    @app.get("/dashboard/api/benchmarks", include_in_schema=False)
    async def benchmarks():
        return benchmark_rows()

    @app.get("/dashboard/report/{name}", include_in_schema=False)
    async def report_chart(name: str) -> Response:
        path = _RESULTS / "report" / name
        if "/" in name or not name.endswith(".png") or not path.is_file():
            return Response(status_code=404)
        return FileResponse(path, media_type="image/png")
