"use strict";
// harness-rl view: renders the View embedded as JSON in #data (see harness_rl/viewer/model.py).
(() => {
  const D = JSON.parse(document.getElementById("data").textContent);
  const TOKEN_CAP = 300; // tokens rendered per turn before "show all"
  const LIST_ROLE = { agent: "agent", summary: "summary", auxiliary: "auxiliary", discarded: "discarded" };
  const SERIES_COLOURS = ["#1f9d55", "#4f46e5", "#7c3aed", "#0e9384", "#b54708", "#1570ef", "#d92d20", "#c11574"];
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const txt = (i) => (i == null ? null : D.texts[i]);
  const clamp01 = (x) => Math.max(0, Math.min(1, x));
  const lerp = (a, b, t) => a + (b - a) * t;

  const state = { query: "", shown: [], selected: null, rendered: undefined, turn: 0, colour: "behaviour", hoverStep: null, expanded: false };

  function num(v) {
    if (v == null || Number.isNaN(v)) return "—";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 10000) return Math.round(v).toLocaleString("en-US");
    if (a < 0.001) return v.toExponential(1);
    return String(Number(v.toPrecision(3)));
  }
  const signed = (v) => (v == null ? "—" : (v > 0 ? "+" : "") + num(v));

  // Colour scales -------------------------------------------------------------------------------
  const rewards = D.rollouts.map((r) => r.reward).filter((r) => r != null);
  const rewardLo = Math.min(0, ...rewards), rewardHi = Math.max(1, ...rewards);
  const rewardT = (r) => clamp01((r - rewardLo) / (rewardHi - rewardLo || 1));
  const rewardHue = (r) => lerp(4, 148, rewardT(r));
  const cellColour = (r) => `hsl(${rewardHue(r)} 58% ${lerp(60, 44, rewardT(r))}%)`;
  function pill(r) {
    if (r == null) return `<span class="pill" style="background:#f2f4f7;color:#98a2b3">—</span>`;
    const h = rewardHue(r);
    return `<span class="pill" style="background:hsl(${h} 70% 92%);color:hsl(${h} 65% 27%)">${num(r)}</span>`;
  }
  // Three stops: calm (pale) -> amber -> coral, by u in [0, 1].
  function ramp(u, calmHue) {
    const stops = [[calmHue, 85, 93], [42, 95, 80], [4, 85, 77]];
    const [a, b, t] = u < 0.5 ? [stops[0], stops[1], u * 2] : [stops[1], stops[2], (u - 0.5) * 2];
    return `hsl(${lerp(a[0], b[0], t)} ${lerp(a[1], b[1], t)}% ${lerp(a[2], b[2], t)}%)`;
  }
  // Behaviour probability on a log scale: p = 1 calm, p <= 0.001 hot.
  const behaviourColour = (lp) => ramp(clamp01(-lp / Math.log(1000)), 214);
  const mismatchColour = (d) => ramp(clamp01(d / 0.5), 150);

  // Tooltip -------------------------------------------------------------------------------------
  const tip = $("tooltip");
  function showTip(event, html) {
    tip.innerHTML = html;
    tip.hidden = false;
    const pad = 14, w = tip.offsetWidth, h = tip.offsetHeight;
    let x = event.clientX + pad, y = event.clientY + pad;
    if (x + w > window.innerWidth - 8) x = event.clientX - w - pad;
    if (y + h > window.innerHeight - 8) y = event.clientY - h - pad;
    tip.style.left = `${Math.max(4, x)}px`;
    tip.style.top = `${Math.max(4, y)}px`;
  }
  const hideTip = () => { tip.hidden = true; };
  const rows = (pairs) => `<table>${pairs.map(([k, v]) => `<tr><td>${esc(k)}</td><td>${v}</td></tr>`).join("")}</table>`;

  // Header --------------------------------------------------------------------------------------
  function renderHeader() {
    $("title").textContent = D.title;
    const steps = D.metrics.length ? D.metrics[D.metrics.length - 1].step : null;
    $("subtitle").textContent = `${D.source} · ${D.tokenizer ? "tokens from " + D.tokenizer : "no tokenizer found: token ids shown"}`;
    const rewardRows = D.metrics.filter((m) => m.reward != null).map((m) => m.reward);
    const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
    const stats = [];
    if (steps != null) stats.push([num(steps), "steps"]);
    stats.push([D.rollouts.length.toLocaleString("en-US"), "rollouts"]);
    const turns = D.rollouts.reduce((a, r) => a + (r.turns ? r.turns.length : 0), 0);
    if (turns) stats.push([turns.toLocaleString("en-US"), "turns"]);
    if (rewardRows.length >= 2) {
      const k = Math.min(3, Math.floor(rewardRows.length / 2));
      stats.push([`${num(mean(rewardRows.slice(0, k)))} → ${num(mean(rewardRows.slice(-k)))}`, "reward"]);
    }
    $("stats").innerHTML = stats.map(([v, l]) => `<div class="stat"><b>${esc(v)}</b><span>${esc(l)}</span></div>`).join("");
  }

  // Charts --------------------------------------------------------------------------------------
  const charts = [];
  const metricSteps = D.metrics.map((m) => m.step);
  function renderCharts() {
    const box = $("charts");
    D.charts.forEach((chart, ci) => {
      const series = chart.keys.map((key) => D.metrics.filter((m) => m[key] != null).map((m) => [m.step, m[key]]))
        .map((pts, i) => ({ key: chart.keys[i], pts })).filter((s) => s.pts.length);
      if (!series.length || series[0].key !== chart.keys[0]) return;
      const band = chart.band ? D.metrics.filter((m) => m[chart.band] != null && m[chart.keys[0]] != null) : [];
      const all = series.flatMap((s) => s.pts);
      const bandValues = band.flatMap((m) => [m[chart.keys[0]] - m[chart.band], m[chart.keys[0]] + m[chart.band]]);
      const ys = [...all.map((p) => p[1]), ...bandValues];
      let lo = Math.min(...ys), hi = Math.max(...ys);
      if (hi === lo) { const pad = Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }
      const [s0, s1] = [metricSteps[0], metricSteps[metricSteps.length - 1]]; // one x axis for every chart
      const X = (s) => (s1 === s0 ? 50 : ((s - s0) / (s1 - s0)) * 100);
      const Y = (v) => 38 - ((v - lo) / (hi - lo)) * 36;
      const colour = SERIES_COLOURS[ci % SERIES_COLOURS.length];
      const path = (pts) => pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(2)},${Y(p[1]).toFixed(2)}`).join("");
      let svg = `<svg viewBox="0 0 100 40" preserveAspectRatio="none">`;
      if (band.length) {
        const upper = band.map((m) => [m.step, m[chart.keys[0]] + m[chart.band]]);
        const lower = band.map((m) => [m.step, m[chart.keys[0]] - m[chart.band]]).reverse();
        svg += `<path class="band" fill="${colour}" d="${path(upper)}${path(lower).replace("M", "L")}Z"/>`;
      }
      series.slice().reverse().forEach((s, i) => {
        svg += `<path class="line${i === series.length - 1 ? "" : " second"}" stroke="${colour}" d="${path(s.pts)}"/>`;
      });
      svg += `<line class="cursor" x1="0" x2="0" y1="0" y2="40"/></svg>`;
      const label = (key) => (chart.labels || [])[chart.keys.indexOf(key)] || key.split("/").pop().replace(/_/g, " ");
      const legend = series.length > 1 ? `<span class="chart-legend">— ${esc(label(series[0].key))}<br>┄ ${esc(label(series[1].key))}</span>`
        : band.length ? `<span class="chart-legend">band: ± std</span>` : "";
      const card = document.createElement("div");
      card.className = "chart";
      card.dataset.key = chart.keys[0];
      card.innerHTML = `<div class="chart-title">${esc(chart.title)}</div>
        <div class="chart-head"><div class="chart-value"></div>${legend}</div>${svg}
        <div class="axis"><span>step ${num(s0)}</span><span>${num(lo)} – ${num(hi)}</span><span>${num(s1)}</span></div>`;
      box.appendChild(card);
      const entry = { card, series, X, s0, s1 };
      charts.push(entry);
      const svgEl = card.querySelector("svg");
      svgEl.addEventListener("mousemove", (e) => {
        const r = svgEl.getBoundingClientRect();
        const step = s0 + clamp01((e.clientX - r.left) / r.width) * (s1 - s0);
        setHoverStep(nearestStep(step));
      });
      svgEl.addEventListener("mouseleave", () => setHoverStep(null));
      svgEl.addEventListener("click", () => { if (state.hoverStep != null) jumpToStep(state.hoverStep); });
      updateChart(entry);
    });
  }
  function nearestStep(step) {
    let best = null;
    for (const s of metricSteps) if (best == null || Math.abs(s - step) < Math.abs(best - step)) best = s;
    return best;
  }
  function updateChart(entry) {
    const pts = entry.series[0].pts;
    let point = pts[pts.length - 1];
    if (state.hoverStep != null) point = pts.find((p) => p[0] === state.hoverStep) || null;
    const value = entry.card.querySelector(".chart-value");
    value.innerHTML = point ? `${num(point[1])}<small>step ${num(point[0])}</small>` : `—<small>step ${num(state.hoverStep)}</small>`;
    const cursor = entry.card.querySelector(".cursor");
    cursor.style.visibility = state.hoverStep == null ? "hidden" : "visible";
    if (state.hoverStep != null) {
      cursor.setAttribute("x1", entry.X(state.hoverStep));
      cursor.setAttribute("x2", entry.X(state.hoverStep));
    }
  }
  function setHoverStep(step) {
    if (step === state.hoverStep) return;
    state.hoverStep = step;
    charts.forEach(updateChart);
  }

  // Order, filter -------------------------------------------------------------------------------
  const order = D.rollouts.map((_, i) => i).sort((a, b) => {
    const ra = D.rollouts[a], rb = D.rollouts[b];
    const key = (r) => [r.step ?? Infinity, r.group_id ?? Infinity];
    const [sa, ga] = key(ra), [sb, gb] = key(rb);
    return sa - sb || ga - gb || a - b;
  });
  const NUMERIC = { reward: "reward", advantage: "advantage", adv: "advantage", env_reward: "env_reward", step: "step",
    group: "group_id", group_id: "group_id", turns: "turn_count", tools: "tool_call_count", exit: "exit_code",
    exit_code: "exit_code", duration: "duration_s" };
  const TEXT = { task: "task", harness: "harness", id: "rollout_id", rollout: "rollout_id", error: "error" };
  const compare = { "=": (a, b) => a === b, "!=": (a, b) => a !== b, "<": (a, b) => a < b, "<=": (a, b) => a <= b,
    ">": (a, b) => a > b, ">=": (a, b) => a >= b };

  function parseQuery(query) {
    const tests = [], errors = [];
    for (const term of query.trim().split(/\s+/).filter(Boolean)) {
      const m = term.match(/^([A-Za-z_]+)(>=|<=|!=|=|<|>)(.*)$/);
      if (m) {
        const field = m[1].toLowerCase(), op = m[2], raw = m[3];
        if (field in NUMERIC) {
          const value = Number(raw);
          if (raw === "" || Number.isNaN(value)) { errors.push(`"${term}": ${raw || "nothing"} is not a number`); continue; }
          const key = NUMERIC[field];
          tests.push((r) => r[key] != null && compare[op](r[key], value));
        } else if (field in TEXT) {
          if (op !== "=" && op !== "!=") { errors.push(`"${term}": use = or != with ${field}`); continue; }
          const key = TEXT[field], needle = raw.toLowerCase();
          tests.push((r) => String(r[key] ?? "").toLowerCase().includes(needle) === (op === "="));
        } else {
          errors.push(`unknown field "${m[1]}"`);
        }
      } else if (term.toLowerCase() === "error") {
        tests.push((r) => !!r.error);
      } else {
        const needle = term.toLowerCase();
        tests.push((r) => [r.rollout_id, r.task, r.harness, r.error].some((v) => String(v ?? "").toLowerCase().includes(needle)));
      }
    }
    return { test: (r) => tests.every((t) => t(r)), errors };
  }

  function applyFilter() {
    const { test, errors } = parseQuery(state.query);
    state.shown = order.filter((i) => test(D.rollouts[i]));
    $("filter").classList.toggle("invalid", errors.length > 0);
    $("filter-error").textContent = errors.join("; ");
    const count = $("count");
    count.dataset.shown = state.shown.length;
    count.dataset.total = D.rollouts.length;
    count.textContent = `${state.shown.length.toLocaleString("en-US")} of ${D.rollouts.length.toLocaleString("en-US")}`;
    syncSelects();
    renderList();
    const visible = new Set(state.shown);
    document.querySelectorAll("#map .cell").forEach((c) => c.classList.toggle("out", !visible.has(+c.dataset.i)));
    const target = visible.has(state.selected) ? state.selected : state.shown.length ? state.shown[0] : null;
    if (target !== state.rendered || target == null) select(target);
    else writeHash();
  }

  function setTerm(field, value) {
    const kept = state.query.trim().split(/\s+/).filter((t) => t && !t.toLowerCase().startsWith(field + "="));
    if (value) kept.push(`${field}=${value}`);
    state.query = kept.join(" ");
    $("filter").value = state.query;
    applyFilter();
  }

  function fillSelect(id, field, label) {
    const values = [...new Set(D.rollouts.map((r) => r[field]).filter(Boolean))].sort();
    const select = $(id);
    select.innerHTML = `<option value="">${label}</option>` + values.map((v) => `<option value="${esc(v)}">${esc(v)}</option>`).join("");
    select.disabled = values.length === 0;
    select.addEventListener("change", () => setTerm(field, select.value));
  }
  function syncSelects() {
    for (const [id, field] of [["harness-select", "harness"], ["task-select", "task"]]) {
      const term = state.query.split(/\s+/).find((t) => t.toLowerCase().startsWith(field + "="));
      const value = term ? term.slice(field.length + 1) : "";
      const select = $(id);
      select.value = [...select.options].some((o) => o.value === value) ? value : "";
    }
  }

  // Hash: "#reward>=0.5", or "#q=<query>&rollout=<id>" as the page writes it ------------------------
  function readHash() {
    const hash = decodeURIComponent(location.hash.replace(/^#/, ""));
    let query = "", rollout = null;
    for (const part of hash.split("&")) {
      if (part.startsWith("q=")) query += " " + part.slice(2);
      else if (part.startsWith("rollout=")) rollout = part.slice(8);
      else if (part) query += " " + part;
    }
    return { query: query.trim(), rollout };
  }
  function writeHash() {
    const r = state.selected == null ? null : D.rollouts[state.selected];
    const parts = [];
    if (state.query) parts.push("q=" + encodeURIComponent(state.query));
    if (r) parts.push("rollout=" + encodeURIComponent(r.rollout_id));
    const hash = parts.length ? "#" + parts.join("&") : " ";
    if (decodeURIComponent(location.hash) !== decodeURIComponent(hash)) history.replaceState(null, "", hash === " " ? location.pathname : hash);
  }

  // Reward map and list -------------------------------------------------------------------------
  function renderMap() {
    const withStep = order.filter((i) => D.rollouts[i].step != null);
    if (!withStep.length) { $("map-card").hidden = true; return; }
    const bySteps = new Map();
    for (const i of withStep) {
      const r = D.rollouts[i];
      if (!bySteps.has(r.step)) bySteps.set(r.step, new Map());
      const groups = bySteps.get(r.step);
      if (!groups.has(r.group_id)) groups.set(r.group_id, []);
      groups.get(r.group_id).push(i);
    }
    const steps = [...bySteps.keys()];
    const every = Math.max(1, Math.ceil(steps.length / 20 / 5) * 5);
    let html = "";
    steps.forEach((step, k) => {
      html += `<div class="map-step" data-step="${step}">`;
      for (const members of bySteps.get(step).values()) {
        members.sort((a, b) => (D.rollouts[b].reward ?? -Infinity) - (D.rollouts[a].reward ?? -Infinity));
        html += `<div class="map-group">` + members.map((i) => {
          const r = D.rollouts[i];
          return r.reward == null ? `<div class="cell null" data-i="${i}"></div>`
            : `<div class="cell" data-i="${i}" style="background:${cellColour(r.reward)}"></div>`;
        }).join("") + `</div>`;
      }
      const label = k === 0 || k === steps.length - 1 || step % every === 0 ? num(step) : "";
      html += `<div class="map-label">${label}</div></div>`;
    });
    const map = $("map");
    map.innerHTML = html;
    map.addEventListener("click", (e) => { const c = e.target.closest(".cell"); if (c) select(+c.dataset.i, true); });
    map.addEventListener("mouseover", (e) => {
      const c = e.target.closest(".cell");
      if (!c) return hideTip();
      const r = D.rollouts[+c.dataset.i];
      showTip(e, `<b>${esc(r.rollout_id)}</b>` + rows([["step", num(r.step)], ["group", num(r.group_id)],
        ["reward", num(r.reward)], ["advantage", signed(r.advantage)], ["task", esc(r.task || "—")]]));
    });
    map.addEventListener("mouseleave", hideTip);
  }

  function renderList() {
    const list = $("list");
    if (!state.shown.length) {
      list.innerHTML = `<div class="empty">${D.rollouts.length ? "No rollout matches the filter." : "This run has no rollouts yet."}</div>`;
      return;
    }
    const stepStats = new Map();
    for (const r of D.rollouts) {
      const s = stepStats.get(r.step) || { n: 0, sum: 0, scored: 0 };
      s.n += 1;
      if (r.reward != null) { s.sum += r.reward; s.scored += 1; }
      stepStats.set(r.step, s);
    }
    let html = "", lastStep, lastGroup;
    for (const i of state.shown) {
      const r = D.rollouts[i];
      if (r.step !== lastStep) {
        const s = stepStats.get(r.step);
        const mean = s.scored ? ` · mean ${num(s.sum / s.scored)}` : "";
        html += `<div class="list-step" data-step="${r.step ?? ""}">${r.step == null ? "No step" : "Step " + num(r.step)}<span>${s.n} rollouts${mean}</span></div>`;
        lastStep = r.step;
        lastGroup = undefined;
      }
      if (r.group_id != null && r.group_id !== lastGroup) {
        html += `<div class="list-group">group ${num(r.group_id)}${r.task ? " · " + esc(r.task) : ""}${r.harness ? " · " + esc(r.harness) : ""}</div>`;
        lastGroup = r.group_id;
      }
      const advColour = r.advantage == null ? "var(--muted)" : r.advantage >= 0 ? "var(--good)" : "var(--bad)";
      const meta = [r.turn_count ? `${r.turn_count} turn${r.turn_count === 1 ? "" : "s"}` : "", r.error ? "⚠" : "", r.timed_out ? "⏱" : ""].filter(Boolean).join(" ");
      html += `<div class="row${i === state.selected ? " selected" : ""}" data-i="${i}" data-rollout="${esc(r.rollout_id)}">
        ${pill(r.reward)}<span style="color:${advColour};font-variant-numeric:tabular-nums;font-size:12px">${signed(r.advantage)}</span>
        <span class="rid" title="${esc(r.rollout_id)}">${esc(r.rollout_id)}</span><span class="meta">${meta}</span></div>`;
    }
    list.innerHTML = html;
  }
  $("list").addEventListener("click", (e) => { const row = e.target.closest(".row"); if (row) select(+row.dataset.i); });

  function jumpToStep(step) {
    const first = state.shown.find((i) => D.rollouts[i].step === step);
    if (first !== undefined) select(first);
  }

  // Selection -----------------------------------------------------------------------------------
  function select(i, scrollList) {
    state.selected = i;
    state.turn = 0;
    state.expanded = false;
    document.querySelectorAll("#list .row.selected, #map .cell.selected").forEach((e) => e.classList.remove("selected"));
    if (i != null) {
      const row = document.querySelector(`#list .row[data-i="${i}"]`);
      if (row) { row.classList.add("selected"); if (scrollList !== false) revealRow(row); }
      document.querySelector(`#map .cell[data-i="${i}"]`)?.classList.add("selected");
    }
    renderDetail();
    state.rendered = i;
    writeHash();
  }
  // Scroll the list (never the page) so the row shows below the sticky step header.
  function revealRow(row) {
    const list = $("list"), header = 30;
    const top = row.offsetTop, bottom = top + row.offsetHeight;
    if (top - header < list.scrollTop || bottom > list.scrollTop + list.clientHeight) {
      list.scrollTop = top - Math.min(list.clientHeight / 3, header * 4);
    }
  }
  function move(delta) {
    if (!state.shown.length) return;
    const at = state.shown.indexOf(state.selected);
    const next = at < 0 ? 0 : Math.max(0, Math.min(state.shown.length - 1, at + delta));
    select(state.shown[next]);
  }

  // The rollout ---------------------------------------------------------------------------------
  const hasLearner = (r) => (r.turns || []).some((t) => t.learner_logps);
  function renderDetail() {
    const box = $("detail");
    if (state.selected == null) {
      box.innerHTML = `<div class="rollout-head"><div class="empty">Nothing to show: ${D.rollouts.length ? "no rollout matches the filter" : "no rollouts in this run yet"}.</div></div>`;
      return;
    }
    const r = D.rollouts[state.selected];
    const turns = r.turns || [];
    const trained = turns.reduce((a, t) => a + [...t.mask].filter((m) => m === "1").length, 0);
    const chips = [];
    if (r.step != null) chips.push(`<span class="chip">step <b>${num(r.step)}</b></span>`);
    if (r.group_id != null) chips.push(`<span class="chip">group <b>${num(r.group_id)}</b></span>`);
    if (r.task) chips.push(`<button class="chip" data-filter="task" data-value="${esc(r.task)}">task <b>${esc(r.task)}</b></button>`);
    if (r.harness) chips.push(`<button class="chip" data-filter="harness" data-value="${esc(r.harness)}">harness <b>${esc(r.harness)}</b></button>`);
    if (r.exit_code != null) chips.push(`<span class="chip">exit <b>${r.exit_code}</b></span>`);
    if (r.tool_call_count != null) chips.push(`<span class="chip">tool calls <b>${r.tool_call_count}</b>${r.tool_failure_count ? ` · <b>${r.tool_failure_count}</b> failed` : ""}</span>`);
    if (r.duration_s != null) chips.push(`<span class="chip"><b>${num(r.duration_s)}</b> s</span>`);
    if (r.timed_out) chips.push(`<span class="chip" style="color:var(--warn)">timed out</span>`);
    const figures = [["reward", num(r.reward)], ["advantage", signed(r.advantage)]];
    if (r.env_reward != null && r.env_reward !== r.reward) figures.push(["env reward", num(r.env_reward)]);
    figures.push(["turns", num(r.turn_count || turns.length)], ["trained tokens", num(trained)]);
    let html = `<section class="rollout-head">
      <div class="rollout-title"><h2>${esc(r.rollout_id)}</h2><div class="chips">${chips.join("")}</div></div>
      <div class="figures">${figures.map(([l, v]) => `<div class="figure"><b>${v}</b><span>${l}</span></div>`).join("")}</div>
      ${r.error ? `<div class="alert error"><b>Error</b> ${esc(r.error)}</div>` : ""}
      ${r.trace_note ? `<div class="alert note">${esc(r.trace_note)}</div>` : ""}
    </section>`;
    if (turns.length) html += graphCard(r) + turns.map((t, k) => turnCard(r, t, k)).join("");
    box.innerHTML = html;
    box.querySelectorAll("button.chip[data-filter]").forEach((b) => b.addEventListener("click", () => setTerm(b.dataset.filter, b.dataset.value)));
  }

  // One lane per branch when the trace has branches (main, subagent, after a compaction, ...), else per chain.
  function lanes(turns) {
    const index = new Map(turns.map((t, k) => [t.node_id, k]));
    const lane = [], used = new Set();
    let next = 0;
    if (turns.length && turns.every((t) => t.branch)) {
      const ids = [...new Set(turns.map((t) => t.branch.id))].sort((a, b) => a - b);
      turns.forEach((t, k) => { lane[k] = ids.indexOf(t.branch.id); });
      return { lane, index, count: ids.length };
    }
    turns.forEach((t, k) => {
      const p = t.parent_id != null ? index.get(t.parent_id) : undefined;
      if (p !== undefined && !used.has(p)) { lane[k] = lane[p]; used.add(p); } else { lane[k] = next++; }
    });
    return { lane, index, count: next };
  }

  function graphCard(r) {
    const turns = r.turns;
    const { lane, index, count } = lanes(turns);
    const GAP = 34, LANE = 24, X = (k) => 18 + k * GAP, Y = (k) => 30 + lane[k] * LANE;
    const width = X(turns.length - 1) + 22, height = 30 + (count - 1) * LANE + 16;
    let edges = "", nodes = "";
    turns.forEach((t, k) => {
      const p = t.parent_id != null ? index.get(t.parent_id) : undefined;
      if (p !== undefined) {
        const [x1, y1, x2, y2] = [X(p), Y(p), X(k), Y(k)];
        edges += y1 === y2 ? `<path class="edge" d="M${x1},${y1}L${x2},${y2}"/>`
          : `<path class="edge" d="M${x1},${y1}C${x1 + GAP * 0.6},${y1} ${x2 - GAP * 0.6},${y2} ${x2},${y2}"/>`;
      }
      const colour = `var(--${LIST_ROLE[t.role] || "discarded"})`;
      const fill = t.prompt_source === "rendered" ? "#fff" : colour;
      const faint = t.prompt_source == null ? ` fill-opacity="0.55"` : "";
      const halo = t.prefix_break ? `<circle cx="${X(k)}" cy="${Y(k)}" r="10.5" fill="none" stroke="var(--bad)" stroke-width="1.6" stroke-dasharray="2.5 2"/>` : "";
      nodes += `<g class="node${k === state.turn ? " current" : ""}" data-k="${k}">${halo}
        <circle class="dot" cx="${X(k)}" cy="${Y(k)}" r="6.5" fill="${fill}"${faint} stroke="${colour}" stroke-width="2.5"/>
        <text x="${X(k)}" y="12" text-anchor="middle">${k}</text></g>`;
    });
    const sources = new Set(turns.map((t) => t.prompt_source ?? "none"));
    const roles = new Set(turns.map((t) => t.role));
    const legend = [];
    for (const role of ["agent", "summary", "auxiliary", "discarded"]) if (roles.has(role)) legend.push(`<span><i class="swatch" style="background:var(--${role})"></i>${role}</span>`);
    if (sources.has("spliced")) legend.push(`<span><i class="swatch solid"></i>spliced</span>`);
    if (sources.has("rendered")) legend.push(`<span><i class="swatch ring"></i>rendered</span>`);
    if (sources.has("none")) legend.push(`<span><i class="swatch solid" style="opacity:.5"></i>prompt source not recorded</span>`);
    if (turns.some((t) => t.prefix_break)) legend.push(`<span><i class="swatch brk"></i>prefix broke</span>`);
    const branches = branchList(turns);
    const learner = hasLearner(r);
    const mode = learner && state.colour === "mismatch" ? "mismatch" : "behaviour";
    const scale = mode === "mismatch"
      ? `<span class="scale">|learner − behaviour logprob| 0 <i style="background:linear-gradient(90deg,${[0, 0.25, 0.5, 0.75, 1].map((u) => mismatchColour(u * 0.5)).join(",")})"></i> ≥ 0.5</span>`
      : `<span class="scale">behaviour p 1 <i style="background:linear-gradient(90deg,${[0, 0.25, 0.5, 0.75, 1].map((u) => behaviourColour(-u * Math.log(1000))).join(",")})"></i> ≤ 0.001</span>`;
    const toggle = learner ? ` <span class="hint">(<kbd>m</kbd> colours by ${mode === "mismatch" ? "behaviour p" : "learner mismatch"})</span>` : "";
    return `<section class="graph-card"><div class="card-title">Turn graph <span class="hint">${turns.length} turns · click a turn · <kbd>n</kbd>/<kbd>p</kbd></span></div>
      <div class="graph-scroll"><svg width="${width}" height="${height}">${edges}${nodes}</svg></div>${branches}
      <div class="legend">${legend.join("")}<span style="flex:1"></span>${scale}<span class="masked-swatch">mask 0</span>${toggle}</div></section>`;
  }

  // The branches of a trace, one per lane from the top: why each began and from which turn.
  function branchList(turns) {
    const first = new Map();
    turns.forEach((t, k) => { if (t.branch && !first.has(t.branch.id)) first.set(t.branch.id, k); });
    if (!first.size) return "";
    const items = [...first.keys()].sort((a, b) => a - b).map((id) => {
      const t = turns[first.get(id)], b = t.branch;
      const from = b.origin != null ? turns.findIndex((u) => u.node_id === b.origin) : -1;
      const count = turns.filter((u) => u.branch && u.branch.id === id).length;
      return `<span class="branch"><b>${id}</b> ${esc(b.reason.replace("_", " "))}${from >= 0 ? ` ← <a href="#" data-goto="${from}">#${from}</a>` : ""} <span class="hint">${count} turn${count === 1 ? "" : "s"}</span></span>`;
    });
    return `<div class="branches"><span class="hint">branches</span>${items.join("")}</div>`;
  }

  function tokenText(id) {
    return D.tokenizer ? D.vocab[id] : undefined;
  }
  function visible(t) {
    if (t === "") return `<span class="ws">∅</span>`;
    return esc(t).replace(/\n/g, `<span class="ws">↵</span>\n`).replace(/\t/g, `<span class="ws">→</span>\t`);
  }
  const SPECIAL = /^<\|.+\|>$|^<\/?[a-z_]+>$/;
  function tokenSpans(t, start, end, mode) {
    let out = "";
    for (let i = start; i < end; i++) {
      const id = t.ids[i], trained = t.mask[i] === "1", piece = tokenText(id);
      let cls = "tok";
      if (!trained) cls += " m0";
      if (piece === undefined) cls += " id";
      else if (SPECIAL.test(piece)) cls += " sp";
      let style = "";
      if (trained) {
        const colour = mode === "mismatch" && t.learner_logps ? mismatchColour(Math.abs(t.learner_logps[i] - t.logps[i])) : behaviourColour(t.logps[i]);
        style = ` style="background:${colour}"`;
      }
      out += `<span class="${cls}" data-i="${i}"${style}>${piece === undefined ? id : visible(piece)}</span>`;
    }
    return out;
  }

  function breakRow(label, ids, other, start, position) {
    const cells = ids.map((id, j) => {
      const piece = tokenText(id);
      const shown = piece === undefined ? `${id} ` : visible(piece);
      const differs = start + j >= position && other[j] !== id;
      return differs ? `<span class="diff">${shown}</span>` : shown;
    }).join("");
    return `<span class="label">${label}</span><span class="toks">${cells || "—"}</span>`;
  }

  function messageHTML(m) {
    const body = txt(m.text);
    const calls = (m.tool_calls || []).map((c) => `<div class="toolcall"><b>${esc(c.name)}</b>(${esc(c.arguments)})</div>`).join("");
    const name = m.name ? `<small title="${esc(m.name)}">${esc(m.name)}</small>` : "";
    const role = ["system", "user", "assistant", "tool"].includes(m.role) ? m.role : "";
    return `<div class="message ${role}"><div class="role">${esc(m.role)}${name}</div><div>
      ${body != null && body !== "" ? `<div class="body${m.role === "tool" ? " mono" : ""}">${esc(body)}</div>` : ""}${calls}</div></div>`;
  }

  function turnCard(r, t, k) {
    const turns = r.turns;
    const parentIndex = t.parent_id != null ? turns.findIndex((u) => u.node_id === t.parent_id) : -1;
    const trained = [...t.mask].filter((m) => m === "1").length;
    const source = t.prompt_source ? `<span class="badge ${t.prompt_source === "rendered" ? "rendered" : "spliced"}">${esc(t.prompt_source)}</span>`
      : `<span class="badge unknown" title="this trace does not record whether the prompt was spliced or rendered">source ?</span>`;
    const nums = [t.policy_version != null ? `v${t.policy_version}` : "", t.finish_reason || "",
      `${num(t.prompt_tokens)} prompt${t.parent_id ? ` (+${num(t.new_prompt_tokens)})` : ""}`,
      `${num(t.ids.length)} completion`, `${num(trained)} trained`, t.duration_s != null ? `${num(t.duration_s)} s` : ""].filter(Boolean).join(" · ");
    const parent = parentIndex >= 0 ? `<span>← <a href="#" data-goto="${parentIndex}">#${parentIndex}</a></span>`
      : t.parent_id ? `<span>← ${esc(t.parent_id)} (missing)</span>` : `<span class="hint" style="margin:0">root</span>`;
    let html = `<section class="turn${k === state.turn ? " current" : ""}" id="turn-${k}" data-k="${k}">
      <div class="turn-head"><span class="index">#${k}</span><span class="badge ${LIST_ROLE[t.role] || "discarded"}">${esc(t.role)}</span>${source}
      ${t.branch ? `<span class="badge branch" title="the conversation this turn belongs to, and why it began">branch ${t.branch.id} · ${esc(t.branch.reason.replace("_", " "))}</span>` : ""}
      ${t.delivered === false ? `<span class="badge undelivered" title="the agent never received this completion">undelivered</span>` : ""}
      <span class="node-id">${esc(t.node_id)}</span>${parent}<span class="spacer"></span><span class="nums">${nums}</span></div>`;
    const b = t.prefix_break;
    if (b) {
      const againstIndex = b.against != null ? turns.findIndex((u) => u.node_id === b.against) : -1;
      const against = againstIndex >= 0 ? ` against <a href="#" data-goto="${againstIndex}">#${againstIndex}</a>` : b.against ? ` against ${esc(b.against)}` : "";
      html += `<div class="alert break"><b>Prefix broke</b> at prompt token ${num(b.position)}${against}: ${esc(b.cause)}`;
      if (b.ours && b.ours.length) {
        html += `<div class="break-view">${breakRow("this prompt", b.ours, b.theirs || [], b.window_start, b.position)}`;
        if (b.theirs && b.theirs.length) html += breakRow("earlier", b.theirs, b.ours, b.window_start, b.position);
        html += `</div>`;
      }
      html += `</div>`;
    }
    if (t.messages && t.messages.length) {
      const what = t.parent_id ? `${t.messages.length} new of ${t.message_count}` : `${t.message_count}`;
      html += `<details class="section" open><summary>Request <span>· ${what} message${t.message_count === 1 ? "" : "s"}</span></summary>
        <div class="messages">${t.messages.map(messageHTML).join("")}</div></details>`;
    }
    const promptText = txt(t.new_prompt_text);
    if (promptText != null) {
      html += `<details class="section"><summary>Prompt tokens <span>· the ${num(t.new_prompt_tokens)} ${t.parent_id ? "new since the parent" : "of the prompt"}, as the model saw them</span></summary>
        <div class="prompt-text">${esc(promptText)}</div></details>`;
    }
    if (t.reply) {
      const parts = [];
      if (txt(t.reply.reasoning)) parts.push(`<div class="body reasoning">${esc(txt(t.reply.reasoning))}</div>`);
      if (txt(t.reply.content)) parts.push(`<div class="body">${esc(txt(t.reply.content))}</div>`);
      parts.push(...(t.reply.tool_calls || []).map((c) => `<div class="toolcall"><b>${esc(c.name)}</b>(${esc(c.arguments)})</div>`));
      if (parts.length) html += `<details class="section"${D.tokenizer ? "" : " open"}><summary>Reply <span>· as the agent received it</span></summary><div class="messages"><div>${parts.join("")}</div></div></details>`;
    }
    const mode = t.learner_logps && state.colour === "mismatch" ? "mismatch" : "behaviour";
    const meanP = t.logps.length ? t.logps.reduce((a, lp) => a + Math.exp(lp), 0) / t.logps.length : null;
    const limit = state.expanded ? t.ids.length : Math.min(t.ids.length, TOKEN_CAP);
    html += `<div class="tokens-head">Completion <span>${num(t.ids.length)} tokens · ${num(trained)} trained${meanP != null ? ` · mean p ${num(meanP)}` : ""}${t.learner_logps ? " · learner logprobs recorded" : ""}</span></div>
      <div class="tokens" data-k="${k}" data-mode="${mode}">${tokenSpans(t, 0, limit, mode)}</div>`;
    if (limit < t.ids.length) html += `<button class="more" data-k="${k}">show all ${num(t.ids.length)} tokens (${num(t.ids.length - limit)} more)</button>`;
    return html + `</section>`;
  }

  function expandTurn(k) {
    const t = D.rollouts[state.selected].turns[k];
    const box = document.querySelector(`.tokens[data-k="${k}"]`);
    const rendered = box.querySelectorAll(".tok").length;
    box.insertAdjacentHTML("beforeend", tokenSpans(t, rendered, t.ids.length, box.dataset.mode));
    document.querySelector(`button.more[data-k="${k}"]`)?.remove();
  }

  function goToTurn(k, scroll) {
    const r = state.selected == null ? null : D.rollouts[state.selected];
    if (!r || !r.turns || !r.turns.length) return;
    state.turn = Math.max(0, Math.min(r.turns.length - 1, k));
    document.querySelectorAll(".turn.current, .graph-card .node.current").forEach((e) => e.classList.remove("current"));
    document.getElementById(`turn-${state.turn}`)?.classList.add("current");
    document.querySelector(`.graph-card .node[data-k="${state.turn}"]`)?.classList.add("current");
    if (scroll !== false) document.getElementById(`turn-${state.turn}`)?.scrollIntoView({ block: "start", behavior: "smooth" });
  }

  const detail = $("detail");
  detail.addEventListener("click", (e) => {
    const more = e.target.closest("button.more");
    if (more) return expandTurn(+more.dataset.k);
    const link = e.target.closest("[data-goto]");
    if (link) { e.preventDefault(); return goToTurn(+link.dataset.goto); }
    const node = e.target.closest(".graph-card .node");
    if (node) return goToTurn(+node.dataset.k);
  });
  detail.addEventListener("mouseover", (e) => {
    const span = e.target.closest(".tok");
    const node = e.target.closest(".graph-card .node");
    if (!span && !node) return hideTip();
    const r = D.rollouts[state.selected];
    if (node) {
      const t = r.turns[+node.dataset.k];
      const trained = [...t.mask].filter((m) => m === "1").length;
      return showTip(e, `<b>#${node.dataset.k}</b> ${esc(t.role)} · ${esc(t.prompt_source || "source not recorded")}` + rows([
        ...(t.branch ? [["branch", `${t.branch.id} · ${esc(t.branch.reason.replace("_", " "))}`]] : []),
        ["node", esc(t.node_id)], ["policy version", num(t.policy_version)], ["prompt", `${num(t.prompt_tokens)} (+${num(t.new_prompt_tokens)} new)`],
        ["completion", num(t.ids.length)], ["trained", num(trained)], ...(t.prefix_break ? [["prefix broke", esc(t.prefix_break.cause)]] : [])]));
    }
    const t = r.turns[+span.closest(".tokens").dataset.k], i = +span.dataset.i;
    const lp = t.logps[i], piece = tokenText(t.ids[i]);
    const pairs = [["token id", t.ids[i]], ["position", i], ["loss mask", t.mask[i]], ["behaviour logprob", num(lp)], ["behaviour p", num(Math.exp(lp))]];
    if (t.learner_logps) pairs.push(["learner logprob", num(t.learner_logps[i])], ["Δ learner − behaviour", signed(t.learner_logps[i] - lp)]);
    const shown = piece === undefined ? "(no tokenizer)" : JSON.stringify(piece).slice(1, -1);
    showTip(e, `<span class="tt-text">${esc(shown)}</span>` + rows(pairs));
  });
  detail.addEventListener("mouseleave", hideTip);

  // Keyboard ------------------------------------------------------------------------------------
  const help = $("help");
  const toggleHelp = (show) => { help.hidden = show === undefined ? !help.hidden : !show; };
  $("help-button").addEventListener("click", () => toggleHelp());
  help.addEventListener("click", (e) => { if (e.target === help) toggleHelp(false); });
  document.addEventListener("keydown", (e) => {
    if (e.metaKey || e.ctrlKey || e.altKey) return;
    const typing = e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement;
    if (e.key === "Escape") { toggleHelp(false); if (typing) e.target.blur(); return; }
    if (typing) return;
    const actions = {
      j: () => move(1), k: () => move(-1), ArrowDown: () => move(1), ArrowUp: () => move(-1),
      n: () => goToTurn(state.turn + 1), p: () => goToTurn(state.turn - 1),
      "/": () => { $("filter").focus(); $("filter").select(); },
      "?": () => toggleHelp(),
      c: () => $("overview").classList.toggle("hidden"),
      e: () => { state.expanded = true; const turn = state.turn; renderDetail(); goToTurn(turn, false); },
      m: () => { state.colour = state.colour === "behaviour" ? "mismatch" : "behaviour"; const turn = state.turn; renderDetail(); goToTurn(turn, false); },
    };
    if (actions[e.key]) { e.preventDefault(); actions[e.key](); }
  });

  // Start ---------------------------------------------------------------------------------------
  let typingTimer;
  $("filter").addEventListener("input", () => {
    clearTimeout(typingTimer);
    typingTimer = setTimeout(() => { state.query = $("filter").value; applyFilter(); }, 120);
  });
  function fromHash() {
    const { query, rollout } = readHash();
    state.query = query;
    $("filter").value = query;
    const wanted = rollout == null ? -1 : D.rollouts.findIndex((r) => r.rollout_id === rollout);
    if (wanted >= 0) state.selected = wanted;
    applyFilter();
  }
  window.addEventListener("hashchange", fromHash);
  renderHeader();
  renderCharts();
  if (!charts.length) $("charts").hidden = true;
  renderMap();
  if (!charts.length && $("map-card").hidden) $("overview").classList.add("hidden");
  fillSelect("harness-select", "harness", "all harnesses");
  fillSelect("task-select", "task", "all tasks");
  fromHash();
  document.body.dataset.ready = "1";
})();
