"""The plan as one self-contained HTML page: inline SVG charts (allocation by pool and model, stranded capacity by
cause) and a GPU-by-GPU occupancy map drawn by an inline script from the data embedded in the page. No network:
no external script, style sheet, font or image. When the script has drawn the map it adds an element with id
`report-rendered` (data-gpus = the GPUs drawn), which a headless browser test looks for."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

_CAUSE_COLORS = {
    "rounding to a profile": "#8c564b", "MIG holes": "#d62728", "mixed-size slots": "#ff7f0e",
    "equal-size type lock": "#e377c2", "hosts short of vCPUs or memory": "#9467bd",
    "carving offers none of the demand": "#7f7f7f", "nothing asked for": "#bcbd22", "usable": "#2ca02c",
}

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}.num{text-align:right}
#map{display:flex;flex-wrap:wrap;gap:2px;max-width:1200px}
.host{display:flex;gap:1px;padding:1px;border:1px solid #bbb}
.gpu{width:10px;height:18px;background:#eee;position:relative}
.gpu i{position:absolute;left:0;bottom:0;width:100%;background:#1f77b4}
.legend span{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px}
"""

_SCRIPT = """
window.addEventListener('error', function(e){
  var p = document.createElement('p'); p.id = 'report-error'; p.textContent = 'script error: ' + e.message;
  document.body.appendChild(p);
});
(function(){
  var data = JSON.parse(document.getElementById('plan-data').textContent);
  var colors = JSON.parse(document.getElementById('cause-colors').textContent);
  var map = document.getElementById('map');
  var hosts = {}, order = [];
  data.gpus.forEach(function(g){
    if(!(g.host in hosts)){ hosts[g.host] = []; order.push(g.host); }
    hosts[g.host].push(g);
  });
  var drawn = 0;
  order.forEach(function(name){
    var box = document.createElement('div'); box.className = 'host'; box.title = name;
    hosts[name].forEach(function(g){
      var cell = document.createElement('div'); cell.className = 'gpu';
      if(g.free_cause && g.used < 1){ cell.style.background = colors[g.free_cause] || '#eee'; }
      var fill = document.createElement('i'); fill.style.height = Math.round(100 * g.used) + '%';
      cell.appendChild(fill);
      cell.title = name + ' ' + g.pci + ' ' + g.model + ' ' + g.mode + (g.pool ? ' pool ' + g.pool : '') +
        ': ' + Math.round(100 * g.used) + '% used, ' + g.devices + ' devices' +
        (g.free_cause ? ', free: ' + g.free_cause : '');
      box.appendChild(cell); drawn++;
    });
    map.appendChild(box);
  });
  var done = document.createElement('p'); done.id = 'report-rendered'; done.setAttribute('data-gpus', String(drawn));
  done.textContent = drawn + ' GPUs drawn';
  document.body.appendChild(done);
})();
"""


def _json_for_script(data: Any) -> str:
    return json.dumps(data, default=str).replace("</", "<\\/").replace("<!--", "<\\!--")


def _bars(rows: Sequence[tuple[str, float, str]], width: int = 520, unit: str = "GPUs") -> str:
    """A horizontal bar chart as inline SVG: (label, value, color) per bar."""
    top = max((v for _, v, _ in rows), default=0.0) or 1.0
    h = 22 * len(rows) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 320}" height="{h}" role="img">']
    for k, (label, value, color) in enumerate(rows):
        y = 5 + 22 * k
        w = max(0.0, value / top * width)
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{escape(label)}</text>'
                     f'<rect x="230" y="{y}" width="{w:.1f}" height="16" fill="{color}"/>'
                     f'<text x="{236 + w:.1f}" y="{y + 13}" font-size="11">{value:g} {unit}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _stacked(rows: Sequence[Mapping[str, Any]], width: int = 520) -> str:
    """Allocated and free GPUs per pool and model, as stacked horizontal bars in inline SVG."""
    top = max((float(r["gpus"]) for r in rows), default=0.0) or 1.0
    h = 22 * len(rows) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 360}" height="{h}" role="img">']
    for k, r in enumerate(rows):
        y = 5 + 22 * k
        a = float(r["allocated"]) / top * width
        f = float(r["free"]) / top * width
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{escape(str(r["pool"]))} / {escape(str(r["model"]))}'
                     f'</text><rect x="230" y="{y}" width="{a:.1f}" height="16" fill="#1f77b4"/>'
                     f'<rect x="{230 + a:.1f}" y="{y}" width="{f:.1f}" height="16" fill="#c7dcef"/>'
                     f'<text x="{236 + a + f:.1f}" y="{y + 13}" font-size="11">{r["allocated"]:g} of {r["gpus"]} '
                     f'GPUs allocated</text>')
    parts.append("</svg>")
    return "".join(parts)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="{"num" if isinstance(c, int | float) else ""}">{escape(str(c))}'
                                    "</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render(plan: Mapping[str, Any], advice: Mapping[str, Any] | None = None, title: str = "vgpu-ctl plan") -> str:
    """The HTML page of a plan (`PlanResult.to_dict()`, with its `gpus`), and of an advice if given."""
    s = plan["summary"]
    stranded = [(c, float(v), _CAUSE_COLORS.get(c, "#17becf")) for c, v in plan["stranded"].items()]
    requests = [(r["request"], r["shape"], r["asked"], r["placed"], r["refused"], r["reason"] or "")
                for r in plan["requests"] if r["refused"] or len(plan["requests"]) <= 200]
    legend = "".join(f'<span style="background:{c}"></span>{escape(k)}' for k, c in _CAUSE_COLORS.items())
    adds = "".join(f"<li>{escape(line)}</li>" for line in plan["add_hosts"]) or "<li>nothing to add</li>"
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>Fleet: {escape(str(plan['fleet']['source']))} ({plan['fleet']['hosts']} hosts, "
        f"{plan['fleet']['gpus']} GPUs). Demand: {escape(str(plan['demand']['source']))} ({plan['demand']['vms']} "
        f"VMs). Policy: {escape(str(plan['policy']))}.</p>",
        f"<p id=\"summary\">Placed <b>{s['placed_vms']}</b> VMs, refused <b>{s['refused_vms']}</b>; "
        f"{s['placed_pct']}% of the demand's GPUs' worth placed; {s['stranded_gpus']} GPUs' worth stranded.</p>",
        "<h2>Allocation by pool and model</h2>", _stacked(plan["allocation"]),
        "<h2>Stranded capacity by cause</h2>", _bars(stranded),
        "<h2>Add hosts to place the rest</h2>", f"<ul>{adds}</ul>",
    ]
    if advice is not None:
        parts += ["<h2>Carving advice</h2>",
                  f"<p id=\"advice\">Today's carving places {advice['today']['placed_vms']} VMs "
                  f"({advice['today']['placed_pct']}%); the advised carving ({escape(str(advice['winner']))}) "
                  f"places {advice['advised']['placed_vms']} ({advice['advised']['placed_pct']}%).</p>",
                  _table(("host", "pci", "model", "pool", "devices", "today", "advised", "action"),
                         [(g["host"], g["pci"], g["model"], g["pool"] or "-", g["devices"], g["today"], g["advised"],
                           g["action"]) for g in advice["gpus"] if g["action"] != "keep"])]
    parts += [
        "<h2>Requests</h2>",
        _table(("request", "shape", "asked", "placed", "refused", "first refusal"), requests),
        "<h2>GPU-by-GPU occupancy</h2>",
        f"<p class=\"legend\">blue: used share; free space colored by cause:{legend}</p>",
        "<div id=\"map\"></div>",
        f"<script type=\"application/json\" id=\"plan-data\">{_json_for_script(plan)}</script>",
        f"<script type=\"application/json\" id=\"cause-colors\">{_json_for_script(_CAUSE_COLORS)}</script>",
        f"<script>{_SCRIPT}</script></body></html>",
    ]
    return "".join(parts)
