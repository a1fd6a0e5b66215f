"""``report.html``: the sweep report's markdown as one self-contained HTML page, its PNGs inlined.

MLflow's artifact viewer (3.17) renders a ``.md`` artifact's tables but prints a markdown image as literal
text, and shows an ``.html`` artifact in a frame built from the file's text, where a relative ``<img src>``
does not resolve: only an image inlined as a ``data:`` URI shows there. The page converts the subset of
markdown the report writes (headings, paragraphs, pipe tables, bullet lists, images, `code`, **bold**).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
STYLE = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; font-size: 14px;
       color: #1f2328; margin: 16px 24px; max-width: 1400px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #d0d7de; }
table { border-collapse: collapse; margin: 8px 0 4px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: right; white-space: nowrap; }
th { background: #f6f8fa; } td:first-child, th:first-child { text-align: left; }
code { background: #f6f8fa; padding: 1px 4px; border-radius: 4px; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; margin: 6px 0; }
p, li { max-width: 1100px; line-height: 1.45; }
"""


def _inline(text: str) -> str:
    out = []
    for i, part in enumerate(text.split("`")):  # odd parts were inside backticks
        if i % 2:
            out.append(f"<code>{html.escape(part)}</code>")
        else:
            esc = html.escape(part)
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", esc))
    return "".join(out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _image(src: str, alt: str, folder: Path) -> str:
    path = folder / src
    try:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
    except OSError:  # the figure is gone: say so rather than show a broken image
        return f"<p><em>figure {html.escape(src)} is missing</em></p>"
    return (
        f'<p><img alt="{html.escape(alt)}" title="{html.escape(src)}" src="data:image/png;base64,{data}"></p>'
    )


def markdown_to_html(markdown: str, folder: str | Path, title: str = "sweep report") -> str:
    """The report's markdown as an HTML page; images (paths relative to ``folder``) inlined as data URIs."""
    folder = Path(folder)
    body: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        if not line.strip():
            i += 1
            continue
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            head, rest = _cells(rows[0]), [r for r in rows[1:] if not re.fullmatch(r"\|?[\s:|-]+\|?", r)]
            body.append(
                "<table><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr></thead>"
            )
            body.append("<tbody>")
            for r in rest:
                body.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(r)) + "</tr>")
            body.append("</tbody></table>")
        elif (m := IMAGE.match(line.strip())) is not None:
            body.append(_image(m["src"], m["alt"], folder))
            i += 1
        elif line.startswith("- "):
            body.append("<ul>")
            while i < len(lines) and lines[i].startswith("- "):
                body.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            body.append("</ul>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "- ", "![")):
                para.append(lines[i].strip())
                i += 1
            body.append(f"<p>{_inline(' '.join(para))}</p>")
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
