"""The HTML report's page and its CSS, as strings, so the report needs no packaged assets (the
script that builds the page from its embedded JSON is `report_script.SCRIPT`)."""

from __future__ import annotations

import html

from .report_script import SCRIPT

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1b1b1b; background: #fafafa; }
header.controls { position: sticky; top: 0; z-index: 2; background: #fff; border-bottom: 1px solid #ccc;
  padding: 8px 16px; display: flex; flex-wrap: wrap; gap: 14px; align-items: center; }
header.controls h1 { font-size: 16px; margin: 0 12px 0 0; }
main { padding: 8px 16px 40px; }
.legend { display: flex; align-items: center; gap: 8px; font-size: 12px; }
.legend .bar { width: 180px; height: 12px; border: 1px solid #999; }
.legend .chip { padding: 0 4px; border-radius: 2px; white-space: nowrap; }
#totals { font-size: 12px; color: #444; }
section.rollout { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: 14px 0; padding: 10px 14px; }
section.rollout h2 { font-size: 15px; margin: 0 0 6px; font-family: ui-monospace, monospace; }
.meta, .summary { display: flex; flex-wrap: wrap; gap: 4px 16px; font-size: 12px; margin-bottom: 6px; }
.meta .key, .summary .key { font-weight: 600; color: #555; }
table.turns { border-collapse: collapse; font-size: 12px; margin: 6px 0 10px; }
table.turns th, table.turns td { border: 1px solid #ddd; padding: 2px 8px; text-align: right; }
table.turns th { background: #f0f0f0; }
.text { font-family: ui-monospace, Menlo, monospace; font-size: 13px; white-space: pre-wrap; word-break: break-all; }
.turn-sep { margin: 8px 0 2px; border-top: 2px solid #888; font: 11px system-ui, sans-serif; color: #555; padding-top: 2px; }
.block { margin: 2px 0; }
.block-label { display: block; font: 10px system-ui, sans-serif; color: #777; text-transform: uppercase; }
.prompt .tok, .env .tok { color: #8a8a8a; }
.env { border: 1px solid #b9b9b9; background: #f3f3f3; border-radius: 4px; padding: 2px 6px; }
.toolcall { outline: 1px solid #e0a000; background: rgba(255, 200, 0, 0.08); border-radius: 2px; }
.tok { border-radius: 2px; }
.tok.special { font-weight: 600; }
.masked { text-decoration: line-through 2px; }
.tok.newline::before { content: "\\21B5"; color: #aaa; font-size: 10px; }
.masked-below { box-shadow: 0 3px 0 rgb(8, 48, 107); }
.masked-above { box-shadow: 0 3px 0 rgb(103, 0, 13); }
.tok.unscored { outline: 1px dotted #999; }
.tok.dark { color: #fff; }
"""


def page(title: str, data_json: str) -> str:
    """The whole document; `data_json` must already be safe inside a script element (html.embed_json)."""
    name = html.escape(title)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{name}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body>
<header class="controls">
  <h1>{name}</h1>
  <label>checkpoint <select id="checkpoint"></select></label>
  <label>objective <select id="objective"></select></label>
  <span>colour by <label><input type="radio" name="color" value="ratio"> ratio</label>
    <label><input type="radio" name="color" value="delta"> |&Delta; log-p|</label></span>
  <span class="legend"><span class="bar" id="legend-bar"></span><span id="legend-ticks"></span>
    <span class="chip" style="color:#8a8a8a">prompt / tool (not sampled)</span>
    <span class="chip masked masked-below">masked below</span> <span class="chip masked masked-above">masked above</span></span>
  <span id="totals"></span>
</header>
<main id="rollouts"></main>
<script type="application/json" id="report-data">{data_json}</script>
<script>{SCRIPT}</script>
</body></html>
"""
