"""The HTML report's script, as a string the page inlines.

It builds the page from the JSON that `html.write_report` embeds (`#report-data`): for each rollout a
header, its figures per checkpoint, a per-turn table and the tokens as running text (one `span.tok`
each, with `data-pos`, `data-sampled`, `data-decision`, `data-side`; the numbers in `title`). Then it
colours every sampled token by the checkpoint, objective and mode the controls pick: by ratio on a
diverging scale (1 white, below one hue, above another, full at the objective's band edge) or by
|delta log-p| in one hue. The controls start from the URL's hash, so a link, or a headless browser, opens
a given view: `report.html#checkpoint=v2&objective=icepop_grpo&color=delta`.
"""

SCRIPT = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var HUES = { below: [33, 102, 172], above: [178, 24, 43], delta: [118, 42, 131] };
  var NEUTRAL = 0.05; // share of the way to the band's edge under which a token reads as unchanged
  var SPECIAL = /^(<\|[^|]*\|>|<\/?(tool_call|tool_response|arg_key|arg_value|think)>)$/;
  var tokens = [], turnRows = [];
  var NAMES = { mean_abs_delta: "mean |\u0394 log-p|", max_abs_delta: "max |\u0394 log-p|", masked_fraction: "masked" };

  function num(x) { return typeof x === "string" ? Number(x) : x; }
  function fmt(x, digits) {
    x = num(x);
    if (x === null || x === undefined) return "\u2014";
    if (typeof x !== "number" || !isFinite(x) || Number.isInteger(x)) return String(x);
    if (x !== 0 && Math.abs(x) < 1e-3) return x.toExponential(2);
    return x.toPrecision(digits || 4);
  }
  function count(x) { return x === null || x === undefined ? "\u2014" : String(x); }
  function figure(name, value) {
    var item = el("span");
    item.appendChild(el("span", "key", name + " "));
    item.appendChild(document.createTextNode(value));
    return item;
  }
  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function unique(lists) {
    var seen = [];
    lists.forEach(function (list) { list.forEach(function (x) { if (seen.indexOf(x) < 0) seen.push(x); }); });
    return seen;
  }
  function mix(hue, t) {
    return "rgb(" + hue.map(function (c) { return Math.round(255 + (c - 255) * t); }).join(", ") + ")";
  }
  function flatten(obj, prefix, out) {
    Object.keys(obj || {}).forEach(function (key) {
      var name = prefix ? prefix + "[" + key + "]" : key, value = obj[key];
      if (value && typeof value === "object" && !Array.isArray(value)) flatten(value, name, out);
      else out.push([name, value]);
    });
    return out;
  }

  var labels = unique(data.rollouts.map(function (r) { return r.checkpoints.map(function (c) { return c.label; }); }));
  var objectives = unique(data.rollouts.map(function (r) {
    return unique(r.tokens.map(function (t) {
      return unique(Object.keys(t.decisions).map(function (k) { return Object.keys(t.decisions[k]); }));
    }));
  }).concat([Object.keys(data.bands)]));
  var state = { checkpoint: labels[labels.length - 1] || "", objective: data.objective || objectives[0] || "", color: "ratio" };
  location.hash.slice(1).split("&").forEach(function (pair) {
    var kv = pair.split("=");
    if (kv.length === 2 && kv[0] in state) state[kv[0]] = decodeURIComponent(kv[1]);
  });

  function tooltip(t) {
    var head = "token " + t.token_id + " " + JSON.stringify(t.text) + " \u00b7 position " + t.position + " \u00b7 turn " + t.turn;
    if (!t.sampled) return head + "\nnot sampled (prompt, tool output or environment)";
    var lines = [head, "rollout log-p " + fmt(t.rollout_logprob) + " \u00b7 version " + count(t.version) +
      " \u00b7 staleness " + count(t.staleness) +
      (t.kv_version === null || t.kv_version === undefined ? "" :
        " \u00b7 KV version " + count(t.kv_version) + " \u00b7 KV staleness " + count(t.kv_staleness)) +
      " \u00b7 temperature " + fmt(t.temperature) +
      (t.nearest_version === null || t.nearest_version === undefined ? "" : " \u00b7 nearest checkpoint v" + t.nearest_version)];
    labels.forEach(function (label) {
      if (!(label in t.logprobs)) return;
      var decided = Object.keys(t.decisions[label] || {}).map(function (o) { return o + " " + t.decisions[label][o]; });
      lines.push(label + ": log-p " + fmt(t.logprobs[label]) + " \u00b7 ratio " + fmt(t.ratios[label]) +
        (decided.length ? " \u00b7 " + decided.join(", ") : ""));
    });
    return lines.join("\n");
  }

  function tokenSpan(t) {
    var span = el("span", "tok " + (t.sampled ? "sampled" : "context") + (SPECIAL.test(t.text) ? " special" : "") +
      (t.text.indexOf("\n") >= 0 ? " newline" : ""), t.text);
    span.dataset.pos = t.position;
    span.dataset.sampled = t.sampled ? "1" : "0";
    span.dataset.turn = t.turn;
    span.dataset.tokenId = t.token_id;
    span.title = tooltip(t);
    tokens.push({ node: span, token: t });
    return span;
  }

  function renderText(r) {
    var text = el("div", "text"), firstTurn = r.tokens.length ? r.tokens[0].turn : 0;
    var block = null, key = null, lastTurn = null, toolcall = null;
    r.tokens.forEach(function (t) {
      var k = t.turn + ":" + t.sampled;
      if (k !== key) {
        key = k;
        toolcall = null;
        if (t.turn !== lastTurn) text.appendChild(el("div", "turn-sep", "turn " + t.turn));
        lastTurn = t.turn;
        var kind = t.sampled ? "completion" : t.turn === firstTurn ? "prompt" : "env";
        block = el("div", "block " + kind);
        block.dataset.kind = kind;
        if (kind === "env") block.appendChild(el("span", "block-label", "tool output / environment"));
        text.appendChild(block);
      }
      if (t.sampled && t.text === "<tool_call>") {
        toolcall = el("span", "toolcall");
        block.appendChild(toolcall);
      }
      (toolcall || block).appendChild(tokenSpan(t));
      if (t.text === "</tool_call>") toolcall = null;
    });
    return text;
  }

  function checkpointTable(own, figures) {
    // One row per checkpoint, one column per figure (a figure split by objective gets one per objective).
    var columns = [];
    Object.keys(figures).forEach(function (key) {
      var subs = unique(own.map(function (label) {
        var v = figures[key][label];
        return v && typeof v === "object" ? Object.keys(v) : [];
      }));
      if (subs.length) subs.forEach(function (sub) { columns.push([NAMES[key] || key, key, sub]); });
      else columns.push([NAMES[key] || key, key, null]);
    });
    var table = el("table", "turns checkpoints"), head = el("tr");
    head.appendChild(el("th", "", "checkpoint"));
    columns.forEach(function (c) { head.appendChild(el("th", "", c[2] ? c[0] + " " + c[2] : c[0])); });
    table.appendChild(head);
    own.forEach(function (label) {
      var row = el("tr");
      row.dataset.checkpoint = label;
      row.appendChild(el("td", "", label));
      columns.forEach(function (c) { var v = figures[c[1]][label]; row.appendChild(el("td", "", fmt(c[2] && v ? v[c[2]] : v))); });
      table.appendChild(row);
    });
    return table;
  }

  function renderRollout(r) {
    var section = el("section", "rollout");
    section.dataset.rolloutId = r.rollout_id;
    section.appendChild(el("h2", "", "rollout " + r.rollout_id + (r.branch ? " \u00b7 branch " + r.branch : "")));
    var meta = el("div", "meta");
    [["task", r.task], ["status", r.status], ["reward", fmt(r.reward)], ["advantage", fmt(r.advantage)], ["group", r.group_id],
     ["account", r.account === undefined || r.account === null ? "\u2014" : r.account],
     ["checkpoints", r.checkpoints.map(function (c) { return c.label + (c.version === null ? "" : " (v" + c.version + ")"); }).join(", ")],
     ["tokens", r.tokens.length + " (" + r.tokens.filter(function (t) { return t.sampled; }).length + " sampled)"]
    ].forEach(function (kv) { meta.appendChild(figure(kv[0], kv[1])); });
    section.appendChild(meta);
    var own = r.checkpoints.map(function (c) { return c.label; }), perCheckpoint = {}, other = {};
    Object.keys(r.summary || {}).forEach(function (key) {
      var value = r.summary[key], keys = value && typeof value === "object" ? Object.keys(value) : [];
      var byLabel = keys.length > 0 && keys.every(function (k) { return own.indexOf(k) >= 0; });
      (byLabel ? perCheckpoint : other)[key] = value;
    });
    var summary = el("div", "summary");
    flatten(other, "", []).forEach(function (kv) {
      summary.appendChild(figure(kv[0], fmt(kv[1])));
    });
    section.appendChild(summary);
    if (Object.keys(perCheckpoint).length) section.appendChild(checkpointTable(own, perCheckpoint));
    var table = el("table", "turns"), head = el("tr");
    ["turn", "sampled", "tool calls", NAMES.mean_abs_delta, NAMES.max_abs_delta, "masked"].forEach(function (h) {
      head.appendChild(el("th", "", h));
    });
    table.appendChild(head);
    r.turns.forEach(function (turn) {
      var row = el("tr"), cells = [turn.index, turn.sampled_tokens, turn.tool_calls, "", "", ""].map(function (v) {
        return row.appendChild(el("td", "", String(v)));
      });
      row.dataset.turn = turn.index;
      table.appendChild(row);
      turnRows.push({ turn: turn, cells: cells });
    });
    section.appendChild(table);
    section.appendChild(renderText(r));
    return section;
  }

  function paintToken(entry, band) {
    var t = entry.token, node = entry.node, cls = node.classList;
    cls.remove("side-below", "side-above", "side-neutral", "side-delta", "masked", "masked-below", "masked-above", "unscored", "dark");
    node.style.backgroundColor = "";
    if (!t.sampled) { node.dataset.side = "context"; node.dataset.decision = "none"; return; }
    var decision = (t.decisions[state.checkpoint] || {})[state.objective];
    node.dataset.decision = decision || "unknown";
    if (decision === "below" || decision === "above") cls.add("masked", "masked-" + decision);
    var lp = num(t.logprobs[state.checkpoint]), rollout = num(t.rollout_logprob);
    if (lp === undefined || lp === null || rollout === null || isNaN(lp)) { node.dataset.side = "unscored"; cls.add("unscored"); return; }
    var ratio = state.checkpoint in t.ratios ? num(t.ratios[state.checkpoint]) : Math.exp(lp - rollout), side, strength;
    if (state.color === "delta") {
      strength = Math.min(1, Math.abs(lp - rollout) / Math.max(-Math.log(band[0]), Math.log(band[1])));
      side = strength < NEUTRAL ? "neutral" : "delta";
      node.style.backgroundColor = mix(HUES.delta, strength);
    } else {
      var logRatio = Math.log(ratio);
      if (isNaN(logRatio)) { node.dataset.side = "unscored"; cls.add("unscored"); return; }
      strength = Math.min(1, Math.abs(logRatio / Math.log(logRatio < 0 ? band[0] : band[1])));
      side = strength < NEUTRAL ? "neutral" : logRatio < 0 ? "below" : "above";
      node.style.backgroundColor = mix(logRatio < 0 ? HUES.below : HUES.above, strength);
    }
    if (strength > 0.6) cls.add("dark");
    node.dataset.side = side;
    cls.add("side-" + side);
  }

  function paintLegend(band) {
    var bar = document.getElementById("legend-bar"), ticks = document.getElementById("legend-ticks");
    if (state.color === "delta") {
      bar.style.background = "linear-gradient(to right, #fff, " + mix(HUES.delta, 1) + ")";
      ticks.textContent = "|\u0394 log-p| 0 \u2026 " + fmt(Math.max(-Math.log(band[0]), Math.log(band[1])), 3) + " (saturates)";
    } else {
      bar.style.background = "linear-gradient(to right, " + mix(HUES.below, 1) + ", #fff, " + mix(HUES.above, 1) + ")";
      ticks.textContent = "ratio " + fmt(band[0], 3) + " \u2190 1 \u2192 " + fmt(band[1], 3) + " (" + state.objective + " band)";
    }
  }

  function paint() {
    var band = (data.bands[state.objective] || [0.8, 1.2]).map(num), masked = 0, sampled = 0;
    tokens.forEach(function (entry) {
      paintToken(entry, band);
      if (entry.token.sampled) { sampled += 1; if (entry.node.classList.contains("masked")) masked += 1; }
    });
    turnRows.forEach(function (row) {
      var t = row.turn;
      row.cells[3].textContent = fmt(t.mean_abs_delta[state.checkpoint]);
      row.cells[4].textContent = fmt(t.max_abs_delta[state.checkpoint]);
      row.cells[5].textContent = fmt((t.masked_fraction[state.checkpoint] || {})[state.objective], 3);
    });
    var totals = document.getElementById("totals");
    totals.dataset.tokens = tokens.length;
    totals.dataset.masked = masked;
    totals.textContent = data.rollouts.length + " rollouts \u00b7 " + tokens.length + " tokens (" + sampled + " sampled) \u00b7 " +
      masked + " masked by " + state.objective + " under " + state.checkpoint;
    paintLegend(band);
    var view = Object.keys(state).map(function (k) { return k + "=" + encodeURIComponent(state[k]); }).join("&");
    try { history.replaceState(null, "", "#" + view); } catch (e) { /* some browsers refuse it on file: URLs */ }
  }

  function fillSelect(id, values) {
    var select = document.getElementById(id);
    values.forEach(function (v) { var option = el("option", "", v); option.value = v; select.appendChild(option); });
    if (values.indexOf(state[id]) < 0) state[id] = values[0] || "";
    select.value = state[id];
    select.addEventListener("change", function () { state[id] = select.value; paint(); });
  }

  fillSelect("checkpoint", labels);
  fillSelect("objective", objectives);
  if (state.color !== "delta") state.color = "ratio";
  Array.prototype.forEach.call(document.querySelectorAll("input[name=color]"), function (input) {
    input.checked = input.value === state.color;
    input.addEventListener("change", function () { state.color = input.value; paint(); });
  });
  var main = document.getElementById("rollouts");
  data.rollouts.forEach(function (r) { main.appendChild(renderRollout(r)); });
  paint();
  document.body.dataset.ready = "1";
})();
"""
