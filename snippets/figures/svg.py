"""A few helpers that write SVG text with the standard library: deterministic, byte for byte."""

from __future__ import annotations

from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "docs" / "assets" / "figures"

FONT = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""


def nice_step(span_ms: float) -> float:
    """A time axis's tick spacing in ms: 1, 2 or 5 times a power of ten, at most 10 ticks."""
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000):
        if span_ms / step <= 10:
            return step
    return 2000


def num(x: float) -> str:
    """A coordinate without float noise: 12 -> '12', 12.5 -> '12.5'."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def document(width: float, height: float, title: str, desc: str, body: list[str],
             defs: list[str] = ()) -> str:
    """A standalone SVG that scales to its container; title and desc are its text alternative."""
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {num(width)} {num(height)}" '
        f'width="100%" role="img" aria-labelledby="title desc" {FONT}>',
        f'<title id="title">{escape(title)}</title>',
        f'<desc id="desc">{escape(desc)}</desc>',
    ]
    if defs:
        head += ["<defs>", *defs, "</defs>"]
    head.append(f'<rect x="0" y="0" width="{num(width)}" height="{num(height)}" fill="#ffffff"/>')
    return "\n".join(head + list(body) + ["</svg>"]) + "\n"


def rect(x, y, w, h, fill="none", stroke="#222222", stroke_width=1, extra="") -> str:
    return (f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{num(stroke_width)}"{extra}/>')


def text(x, y, s, size=14, anchor="middle", weight="normal", fill="#111111") -> str:
    return (f'<text x="{num(x)}" y="{num(y)}" font-size="{num(size)}" text-anchor="{anchor}" '
            f'dominant-baseline="middle" font-weight="{weight}" fill="{fill}">{escape(s)}</text>')


def line(x1, y1, x2, y2, stroke="#222222", width=1, extra="") -> str:
    return (f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" '
            f'stroke="{stroke}" stroke-width="{num(width)}"{extra}/>')


def hatch_pattern(pattern_id: str, color: str = "#888888") -> str:
    """Diagonal stripes, so idle time reads without colour."""
    return (f'<pattern id="{pattern_id}" patternUnits="userSpaceOnUse" width="8" height="8" '
            f'patternTransform="rotate(45)"><rect width="8" height="8" fill="#f4f4f4"/>'
            f'<line x1="0" y1="0" x2="0" y2="8" stroke="{color}" stroke-width="3"/></pattern>')


def write(name: str, svg: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.svg"
    path.write_text(svg, encoding="utf-8", newline="\n")
    return path
