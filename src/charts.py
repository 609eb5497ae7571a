"""Saving altair charts as PNG and SVG (through vl-convert), to the run's output folder, and their
titles with where their numbers come from."""
from __future__ import annotations

from pathlib import Path

from . import project_root


def check_out_dir(out_dir: str | Path | None) -> None:
    """out_dir empty or absolute: the notebooks run in notebooks/ (papermill --cwd), so a relative
    one would land there, not where the caller's shell is. A notebook checks it with its other
    parameters, before any GPU work, not at its first chart."""
    if out_dir and not Path(out_dir).is_absolute():
        raise ValueError(f"out_dir: {str(out_dir)!r} is relative, and the notebook runs in notebooks/; "
                         "give an absolute path (make run passes one)")


def chart_dir(out_dir: str | Path | None = None) -> Path:
    """Where charts go: <out_dir>/charts for a papermill run, else runs/interactive/charts."""
    check_out_dir(out_dir)
    base = Path(out_dir) if out_dir else project_root() / "runs" / "interactive"
    d = base / "charts"
    d.mkdir(parents=True, exist_ok=True)
    return d


def save_chart(chart, name: str, out_dir: str | Path | None = None) -> list[Path]:
    """Write <name>.png and <name>.svg; returns their paths."""
    d = chart_dir(out_dir)
    paths = [d / f"{name}.png", d / f"{name}.svg"]
    chart.save(str(paths[0]), scale_factor=2)
    chart.save(str(paths[1]))
    return paths


def chart_title(text: str, source: str = ""):
    """A chart title with where its numbers come from (e.g. results.source_label, or
    "recorded: NVIDIA H200 (run ...)") as its subtitle, so that a saved chart says it too."""
    import altair as alt

    return alt.TitleParams(text, subtitle=source) if source else text
