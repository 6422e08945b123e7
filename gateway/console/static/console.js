"use strict";
// tokengate's operator console (docs/operations.md, "The operator console"). Every figure and
// every action goes through the admin API, with the admin token the operator typed in: kept in
// this tab's sessionStorage, sent only in the Authorization header, never in a URL. Data is
// written with textContent only: tenant and key names are the operators' input.

const TOKEN_KEY = "tokengate.admin";
const LIVE_MS = 1000; // the live view's refresh
const TENANTS_MS = 5000; // the tenants view's refresh (an hour of usage per tenant)
const HISTORY = 120; // points kept for the charts (2 min at 1 refresh/s; status.HISTORY_S)
const WINDOW_S = 30; // contract accuracy is drawn over this sliding window

const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem(TOKEN_KEY);
let view = null;
let timer = null;

// -- the admin API ---------------------------------------------------------------------

async function api(method, path, body) {
  const init = { method, headers: { authorization: "Bearer " + token }, cache: "no-store" };
  if (body !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  const text = await res.text();
  let doc = null;
  try { doc = text ? JSON.parse(text) : null; } catch (_) { doc = null; }
  if (!res.ok) {
    const err = new Error(doc && doc.error ? doc.error.message : `${res.status} ${res.statusText}`);
    err.status = res.status;
    err.code = doc && doc.error ? doc.error.code : null;
    if (res.status === 401 && view !== "login") signOut(err.message);
    throw err;
  }
  return doc;
}

// -- drawing helpers -------------------------------------------------------------------

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function table(target, head, rows) {
  const frag = document.createDocumentFragment();
  const tr = el("tr");
  for (const h of head) tr.append(el("th", h));
  frag.append(tr);
  for (const row of rows) {
    const line = el("tr");
    const cells = Array.isArray(row) ? row : row.cells;
    if (!Array.isArray(row)) {
      if (row.cls) line.className = row.cls;
      if (row.onclick) line.addEventListener("click", row.onclick);
      if (row.id) line.dataset.id = row.id;
    }
    for (const c of cells) {
      const td = el("td");
      if (c instanceof Node) td.append(c); else td.textContent = c === null || c === undefined ? "–" : String(c);
      line.append(td);
    }
    frag.append(line);
  }
  target.replaceChildren(frag);
}

function num(v, digits = 0) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"; }

function bar(used, total) {
  const wrap = el("span");
  const b = el("span", null, "bar");
  const fill = el("span");
  fill.style.width = total > 0 ? Math.min(100, (100 * used) / total) + "%" : "0";
  b.append(fill);
  wrap.append(b, `${used} / ${total}`);
  return wrap;
}

function chart(svg, series, top) {
  // series: [{values: [number|null], cls}]; y from 0 to top (at least the highest value)
  const max = Math.max(top || 0, ...series.flatMap((s) => s.values.filter((v) => v !== null)), 1e-9);
  const ns = "http://www.w3.org/2000/svg";
  const lines = [];
  for (const s of series) {
    let points = [];
    const flush = () => {
      if (points.length) {
        const line = document.createElementNS(ns, "polyline");
        line.setAttribute("points", points.join(" "));
        line.setAttribute("class", s.cls);
        lines.push(line);
      }
      points = [];
    };
    s.values.forEach((v, i) => {
      if (v === null) { flush(); return; }
      const x = (400 * i) / Math.max(HISTORY - 1, 1);
      points.push(`${x.toFixed(1)},${(100 - (96 * v) / max - 2).toFixed(1)}`);
    });
    flush();
  }
  svg.replaceChildren(...lines);
  return max;
}

// -- views -----------------------------------------------------------------------------

const VIEWS = { live: refreshLive, tenants: refreshTenants, request: null };

function show(name) {
  if (!token) name = "login";
  else if (!(name in VIEWS)) name = "live";
  view = name;
  for (const section of document.querySelectorAll("section.view")) section.hidden = section.id !== name;
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("on", a.dataset.view === name);
  $("nav").hidden = $("logout").hidden = name === "login";
  clearTimeout(timer);
  timer = null;
  if (VIEWS[name]) tick(name);
}

async function tick(name) {
  if (view !== name || document.hidden) return;
  try { await VIEWS[name](); } catch (_) { /* each view shows its own error */ }
  if (view === name) timer = setTimeout(() => tick(name), name === "live" ? LIVE_MS : TENANTS_MS);
}

function signOut(message) {
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  $("login-error").textContent = message || "";
  $("where").textContent = "";
  show("login");
}

// -- live --------------------------------------------------------------------------------

const live = { prev: null, traffic: [[], [], []], contracts: {}, samples: [] };

function latest(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
  return null;
}

function push(list, v) { list.push(v); if (list.length > HISTORY) list.shift(); }

function contractCells(counters) {
  // path -> component -> {inside, outside, error_sum, errors}
  const out = [];
  for (const [path, comps] of Object.entries(counters.contracts || {}).sort()) {
    for (const [component, c] of Object.entries(comps).sort()) out.push({ key: `${path} ${component}`, ...c });
  }
  return out;
}

function showModels(models, current) {
  const select = $("model");
  if ([...select.options].map((o) => o.value).join("\n") !== models.join("\n")) {
    select.replaceChildren(...models.map((m) => new Option(m, m)));
  }
  select.value = current;
  select.hidden = models.length < 2;
}

async function refreshLive() {
  let c;
  const chosen = $("model").value;  // a gateway serving several models: one model's domain at a time
  const path = chosen ? `/admin/cluster?model=${encodeURIComponent(chosen)}` : "/admin/cluster";
  try { c = await api("GET", path); } catch (e) { $("live-error").textContent = e.message; throw e; }
  $("live-error").textContent = "";
  showModels(c.models || [c.model], c.model);
  const me = c.gateways.find((g) => g.gateway === c.gateway);
  $("where").textContent = `model ${c.model} · gateway ${c.gateway} (${me ? me.role : "?"}) · ` +
    `${c.gateways.length} gateway(s) · ${c.workers.length} worker(s)`;
  const k = c.counters;
  // the traffic chart: the gateways' rates over the last 2 min, worked out by the gateway that
  // answers from each gateway's own recent samples (gateway/console/status.py, traffic), so the
  // chart is full as soon as the page opens; the cards show its last point
  const t = k.traffic;
  live.traffic = [t.admitted, t.refused, t.budget_waits];
  $("rate-admitted").textContent = num(latest(t.admitted), 1);
  $("rate-refused").textContent = num(latest(t.refused), 1);
  $("rate-waits").textContent = num(latest(t.budget_waits), 1);
  const prev = live.prev;
  live.prev = { at: c.at, responses: k.responses };
  if (prev && c.at > prev.at) {  // the refusals' statuses, over the refresh (a breakdown, not a chart)
    const dt = c.at - prev.at;
    const by = Object.entries(k.responses).filter(([s]) => Number(s) >= 400 && s !== "499")
      .map(([s, n]) => [s, Math.max(0, n - (prev.responses[s] || 0)) / dt]).filter(([, v]) => v > 0);
    $("refused-by").textContent = by.map(([s, v]) => `${s}: ${num(v, 1)}/s`).join(" · ");
  }
  $("in-flight").textContent = num(c.gateways.reduce((n, g) => n + g.in_flight, 0));
  const s = c.scheduler;
  $("queued").textContent = s ? num(s.queued) : "–";
  const top = chart($("chart-traffic"), live.traffic.map((values, i) => ({ values, cls: "c" + i })));
  $("traffic-top").textContent = `top of the chart: ${num(top, 1)}/s`;

  // contract accuracy: cumulative per path and component, windowed for the chart
  const cells = contractCells(k);
  live.samples.push({ at: c.at, cells: Object.fromEntries(cells.map((x) => [x.key, x])) });
  while (live.samples.length > 1 && c.at - live.samples[0].at > WINDOW_S) live.samples.shift();
  const first = live.samples[0];
  for (const x of cells) {
    const then = first.cells[x.key] || { inside: 0, outside: 0 };
    const n = x.inside + x.outside - then.inside - then.outside;
    if (!live.contracts[x.key]) live.contracts[x.key] = Array(HISTORY - 1).fill(null);
    push(live.contracts[x.key], n > 0 ? (x.inside - then.inside) / n : null);
  }
  for (const [key, values] of Object.entries(live.contracts)) if (!cells.find((x) => x.key === key)) push(values, null);
  const keys = Object.keys(live.contracts).sort();
  chart($("chart-contracts"), keys.map((key, i) => ({ values: live.contracts[key], cls: "c" + (i % 6) })), 1);
  $("contracts-legend").replaceChildren(...keys.map((key, i) => el("span", key + " ", "k c" + (i % 6))));
  table($("contracts"), ["path", "component", "finished", "inside p99 bound", "mean abs. error"],
    cells.map((x) => {
      const n = x.inside + x.outside;
      return [x.key.split(" ")[0], x.key.split(" ")[1], num(n), pct(n ? x.inside / n : null),
        pct(x.errors ? x.error_sum / x.errors : null)];
    }));

  drawPolicy(s, c.tuning);
  if (s) {
    table($("buckets"), ["bucket", "prompt ≤", "queued", "tokens", "arrivals/s", "mean output"],
      (s.buckets || []).map((b) => [b.bucket, num(b.max_prompt), num(b.queued), num(b.tokens), num(b.arrival_rate, 2),
        num(b.mean_output, 0)]));
    table($("paths"), ["path", "workers", "slots", "in flight", "slot limit", "step ms", "speed vs profile", "KV tokens",
      "prefill queued", "saved state"],
      // only paths with slots or requests (status.scheduler_view): none on a CPU-only box's gpu
      Object.entries(s.paths || {}).map(([name, p]) => [name, p.workers === 0 ? "no workers" : p.workers, p.capacity,
        p.in_flight, p.slot_limit, num(1000 * p.step_s, 1), speed(p.drift), num(p.kv_tokens), num(p.pending_prefill),
        (s.saved_state || {})[name] || "–"]));
    table($("backlog"), ["pool", "requests", "tokens"],
      Object.entries(s.backlog || {}).map(([pool, b]) => [pool, num(b.requests), num(b.tokens)]));
  } else {
    for (const id of ["buckets", "paths", "backlog"]) table($(id), ["no gateway schedules now"], []);
  }
  table($("workers"), ["worker", "pool", "engine", "device", "dtype", "AMX", "in flight / slots", "heartbeat",
    "prefill tok/s", "decode step", "profile", "CPU wait now", "threads", "tok/s", "state"],
  c.workers.map((w) => [w.worker, w.pool, w.engine, w.gpu || w.cpu || w.device, w.dtype,
    w.amx === null || w.amx === undefined ? "–" : w.amx_used ? "in use" : w.amx ? "present, unused" : "no",
    bar(w.slots - w.free, w.slots), w.heartbeat_age_s === null ? "–" : num(w.heartbeat_age_s, 1) + " s",
    num(w.prefill_tokens_per_s), w.decode_step_ms === null ? "–" : num(w.decode_step_ms, 1) + " ms",
    w.profile_how ? w.profile_how + (w.profile_starved >= STARVED ? ", starved " + pct(w.profile_starved) : "") : "–",
    pct(w.cpu_starved), w.threads_now ? w.threads_now + " of " + w.threads : "–", num(w.tokens_per_s, 1),
    w.down ? "down: " + w.down : "serving"]));
  table($("gateways"), ["gateway", "role", "in flight", "last report"],
    c.gateways.map((g) => ({ cells: [g.gateway, g.role, g.in_flight, num(g.age_s, 1) + " s ago"],
      cls: g.gateway === c.gateway ? "on" : "" })));
}

// a worker whose threads waited this share of their time for a CPU was starved (common.protocol.STARVED_SHARE)
const STARVED = 0.1;

// the step-time model's drift: how much slower (or faster) the path runs than its workers' profiles
function speed(drift) {
  if (drift === undefined || drift === null || Math.abs(drift - 1) < 0.005) return "as measured";
  return drift > 1 ? num(drift, 2) + "x slower" : num(1 / drift, 2) + "x faster";
}

function drawPolicy(s, t) {
  const box = $("policy");
  if (!s || !s.policy) { box.replaceChildren(el("p", "no gateway schedules now", "muted")); return; }
  const p = s.policy;
  const head = el("p");
  head.append("policy ", el("strong", p.spec || p.name), p.name && p.name !== p.spec ? ` (table ${p.name})` : "",
    " · macro-state ", el("strong", p.state || "–", "state"));
  const action = el("p", null, "mono small");
  action.textContent = p.action ? "action: " + Object.entries(p.action).map(([k, v]) => `${k}=${v}`).join("  ")
    : "action: the configured knobs (the heuristic)";
  // the 12 macro-states: queue level × a long prompt waiting × a full path (docs/scheduling.md §16)
  const visits = el("table");
  const seen = p.visits || {};
  const suffixes = ["", "+full", "+long", "+long+full"];
  const levels = [...new Set(Object.keys(seen).map((name) => name.split("+")[0]))];
  table(visits, ["visits", ...suffixes.map((x) => x || "(plain)")], levels.map((level) => {
    const cells = suffixes.map((x) => {
      const name = level + x;
      const td = el("span", name in seen ? num(seen[name]) : "–", name === p.state ? "state-now" : "");
      return td;
    });
    return [level, ...cells];
  }));
  box.replaceChildren(head, action, visits, ...drawTuning(t));
}

// the self-tuning (docs/scheduling.md §16.2): the table in force, a re-solve running, its last
// verdict, the watch of the last swap, and the changes, newest first
function drawTuning(t) {
  if (!t) return [];
  const when = (at) => new Date(at * 1000).toLocaleString();
  const out = [];
  const line = el("p", null, "small");
  if (!t.enabled) line.textContent = "self-tuning: off (a fixed policy)";
  else {
    line.append("self-tuning: ", el("strong", t.every_s ? `every ${num(t.every_s / 60)} min` : "when asked"),
      t.in_force ? ` · table in force since ${when(t.in_force.since)} (${t.in_force.kind}): ${t.in_force.why}`
        : " · the packaged table is in force");
  }
  out.push(line);
  const st = t.status || {};
  if (st.solving_since) out.push(el("p", `re-solving since ${when(st.solving_since)} (${st.reason || ""})`, "small"));
  if (st.last) {
    out.push(el("p", `last re-solve ${when(st.last.at)}: ${st.last.swap ? "swapped" : "kept"}: ${st.last.why}`,
      "small"));
  }
  if (st.watch && st.watch.watching) {
    out.push(el("p", `watching the swap: ${st.watch.outcomes_after_swap} of ${st.watch.needed} outcomes in`, "small"));
  }
  if (st.judged) out.push(el("p", `last swap judged ${when(st.judged.at)}: ${st.judged.why}`, "small"));
  if ((t.changes || []).length) {
    const changes = el("table");
    table(changes, ["changed", "kind", "from", "to", "why"],
      t.changes.map((c) => [when(c.at), c.kind, c.from || "–", c.to, c.why]));
    out.push(changes);
  }
  return out;
}

// -- tenants -------------------------------------------------------------------------------

const tenants = { list: [], selected: null };

async function refreshTenants() {
  const [list, usage] = await Promise.all([api("GET", "/admin/tenants"), api("GET", "/admin/usage")]);
  const used = Object.fromEntries(usage.data.map((u) => [u.tenant, u]));
  tenants.list = list.data;
  table($("tenant-list"), ["name", "id", "rate tok/s", "burst", "priority", "max concurrent", "max prompt",
    "max output", "tokens this min", "tokens last hour", "requests last hour", "429s last hour", "SLO attainment"],
  list.data.map((t) => {
    const u = used[t.id];
    const h = u ? u.hour : null;
    const judged = h ? h.slo_met + h.slo_missed : 0;
    return { id: t.id, cls: "pick" + (t.id === tenants.selected ? " on" : ""), onclick: () => select(t.id),
      cells: [t.name, t.id, num(t.rate, 1), num(t.burst), t.priority, t.limits.max_concurrent,
        t.limits.max_prompt_tokens, t.limits.max_output_tokens, num(u ? u.minute.total_tokens : 0),
        num(h ? h.total_tokens : 0), num(h ? h.requests : 0), num(h ? h.rate_limited : 0),
        judged ? pct(h.slo_met / judged) + ` of ${judged}` : "–"] };
  }));
  if (tenants.selected && !list.data.find((t) => t.id === tenants.selected)) select(null);
}

function field(name, t) {
  if (name.startsWith("limits.")) return t.limits[name.slice(7)];
  return t[name];
}

const OPTIONAL = new Set(["slo_ttft_ms", "slo_tpot_ms", "limits.max_prompt_tokens", "limits.max_output_tokens",
  "limits.max_concurrent"]);

function named(form, name) { return form.elements.namedItem(name).value; }

function value(raw) {
  // a number where the text is one; otherwise the text, for the admin API to refuse in its own words
  const text = raw.trim();
  return text !== "" && Number.isFinite(Number(text)) ? Number(text) : text;
}

async function select(id) {
  tenants.selected = id;
  for (const tr of $("tenant-list").querySelectorAll("tr")) tr.classList.toggle("on", tr.dataset.id === id);
  $("tenant-panel").hidden = !id;
  $("new-key-box").hidden = true;
  $("edit-error").textContent = $("key-error").textContent = "";
  if (!id) return;
  const t = tenants.list.find((x) => x.id === id);
  $("tenant-name").textContent = t.name;
  for (const input of $("edit-form").querySelectorAll("input")) {
    const v = field(input.name, t);
    input.value = v === null || v === undefined ? "" : String(v);
  }
  await loadKeys();
}

async function loadKeys() {
  const id = tenants.selected;
  const keys = await api("GET", `/admin/tenants/${encodeURIComponent(id)}/keys`);
  table($("keys"), ["prefix", "name", "created", ""], keys.data.map((k) => {
    const revoke = el("button", "Revoke", "quiet");
    revoke.dataset.prefix = k.prefix;
    revoke.addEventListener("click", async () => {
      try { await api("DELETE", `/admin/keys/${encodeURIComponent(k.prefix)}`); await loadKeys(); }
      catch (e) { $("key-error").textContent = e.message; }
    });
    return [`tg-${k.prefix}-…`, k.name, new Date(k.created * 1000).toLocaleString(), revoke];
  }));
}

function wire() {
  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    $("token").value = "";
    try {
      await api("GET", "/admin/cluster");
    } catch (e) {
      signOut(e.message);
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("login-error").textContent = "";
    show(location.hash.slice(1) || "live");
  });
  $("logout").addEventListener("click", () => signOut("Signed out."));
  $("model").addEventListener("change", () => {  // another model's domain: its own counters from now on
    Object.assign(live, { prev: null, traffic: [[], [], []], contracts: {}, samples: [] });
    refreshLive().catch(() => {});
  });
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  document.addEventListener("visibilitychange", () => { if (!document.hidden && view) show(view); });

  $("create-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = ev.target;
    const body = { name: named(form, "name").trim(), rate: value(named(form, "rate")) };
    for (const name of ["burst", "priority"]) if (named(form, name).trim() !== "") body[name] = value(named(form, name));
    try {
      const t = await api("POST", "/admin/tenants", body);
      $("create-error").textContent = "";
      form.reset();
      await refreshTenants();
      await select(t.id);
    } catch (e) { $("create-error").textContent = e.message; }
  });

  $("edit-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const t = tenants.list.find((x) => x.id === tenants.selected);
    const patch = {};
    for (const input of ev.target.querySelectorAll("input")) {
      const was = field(input.name, t);
      const text = input.value.trim();
      if (text === (was === null || was === undefined ? "" : String(was))) continue;
      let v = value(text);
      if (text === "") { if (!OPTIONAL.has(input.name)) continue; v = null; }
      if (input.name.startsWith("limits.")) (patch.limits = patch.limits || {})[input.name.slice(7)] = v;
      else patch[input.name] = v;
    }
    try {
      const updated = await api("PATCH", `/admin/tenants/${encodeURIComponent(t.id)}`, patch);
      $("edit-error").textContent = Object.keys(patch).length ? "Saved." : "Nothing changed.";
      Object.assign(t, updated);
      await refreshTenants();
    } catch (e) { $("edit-error").textContent = e.message; }
  });

  $("key-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = named(ev.target, "name").trim();
    try {
      const k = await api("POST", `/admin/tenants/${encodeURIComponent(tenants.selected)}/keys`, name ? { name } : {});
      $("new-key").textContent = k.key;
      $("new-key-box").hidden = false;
      $("key-error").textContent = "";
      ev.target.reset();
      await loadKeys();
    } catch (e) { $("key-error").textContent = e.message; }
  });

  $("request-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const rid = $("rid").value.trim();
    try {
      const doc = await api("GET", `/admin/requests/${encodeURIComponent(rid)}`);
      $("request-error").textContent = "";
      drawRequest(doc, await tenantName(doc.tenant));
    } catch (e) {
      $("request-error").textContent = e.message;
      table($("record"), [], []);
      table($("schedule"), [], []);
    }
  });
}

// a request's record names its tenant by id: its name from the tenants view's list, else asked
// of the admin API (null for a tenant deleted since)
async function tenantName(id) {
  if (!id) return null;
  const known = tenants.list.find((t) => t.id === id);
  if (known) return known.name;
  try { return (await api("GET", `/admin/tenants/${encodeURIComponent(id)}`)).name; } catch (_) { return null; }
}

function drawRequest(doc, tenant) {
  const ms = (s) => (s === undefined ? "–" : num(1000 * s, 0) + " ms");
  // the record holds the contract once the request is settled; until then the scheduler has it
  const c = doc.schedule && doc.schedule.contract;
  if (c && doc.contract_ttft_s === undefined) {
    Object.assign(doc, { contract_ttft_s: c.ttft_s, contract_ttft_p99_s: c.ttft_p99_s, contract_total_s: c.total_s,
      contract_p99_s: c.p99_s });
  }
  const rows = [
    ["id", doc.id], ["tenant", tenant ? `${tenant} (${doc.tenant})` : doc.tenant], ["state", doc.state],
    ["admitted", doc.admitted_at ? new Date(doc.admitted_at * 1000).toLocaleString() : "–"],
    ["prompt tokens", num(doc.prompt_tokens)], ["reserved tokens", num(doc.reserved_tokens)],
    ["charged tokens", num(doc.charged_tokens)], ["budget wait", ms(doc.budget_wait_s)],
    ["promised first token (p50 / p99)", `${ms(doc.contract_ttft_s)} / ${ms(doc.contract_ttft_p99_s)}`],
    ["promised total (p50 / p99)", `${ms(doc.contract_total_s)} / ${ms(doc.contract_p99_s)}`],
    ["actual first token", ms(doc.ttft_s)], ["actual total", ms(doc.total_s)],
  ];
  if (doc.ttft_s !== undefined && doc.contract_ttft_p99_s !== undefined) {
    rows.push(["first token inside its bound", doc.ttft_s <= doc.contract_ttft_p99_s ? "yes" : "no"]);
  }
  if (doc.total_s !== undefined && doc.contract_p99_s !== undefined) {
    rows.push(["total inside its bound", doc.total_s <= doc.contract_p99_s ? "yes" : "no"]);
  }
  table($("record"), ["", ""], rows);
  const s = doc.schedule;
  const shown = (v) => (v !== null && typeof v === "object" ? JSON.stringify(v)
    : typeof v === "number" ? num(v, Number.isInteger(v) ? 0 : 4) : v);
  table($("schedule"), ["", ""], s ? Object.entries(s).filter(([k]) => k !== "contract").map(([k, v]) => [k, shown(v)])
    : [["", "not held by the scheduler: it has not arrived, or has ended"]]);
}

wire();
show(location.hash.slice(1) || "live");
