// SkyMesh dashboard: polls the controller's admin API and draws the mesh.
// No library and no CDN: the controller may run where there is no network. Every value
// from the API goes into the page as text (textContent), never as markup.
"use strict";

const POLL_MS = 2000;
const TELEMETRY_LIMIT = 2000;
const CHART_SPAN_S = 600; // charts show the last ten minutes
const TOKEN_KEY = "skymesh_controller.token";
const SVG_NS = "http://www.w3.org/2000/svg";

class Unauthorized extends Error {}

// -- token ------------------------------------------------------------------------------

function tokenFromFragment() {
  // Scripts open /dashboard#token=...; the token moves to sessionStorage and leaves the
  // address bar so it is not bookmarked, shared or kept in history.
  const m = /(?:^|&)token=([^&]*)/.exec(location.hash.slice(1));
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

const token = () => sessionStorage.getItem(TOKEN_KEY);

// -- API --------------------------------------------------------------------------------

async function errorMessage(r) {
  try {
    return (await r.json()).error.message;
  } catch {
    return r.statusText;
  }
}

async function api(path, { missingOk = false } = {}) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token() }, cache: "no-store" });
  if (r.status === 401 || r.status === 403) throw new Unauthorized(`${r.status} ${await errorMessage(r)}`);
  if (missingOk && r.status === 404) return null;
  if (!r.ok) throw new Error(`${path}: ${r.status} ${await errorMessage(r)}`);
  return r.json();
}

// -- DOM helpers ------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  node.append(...children.filter((c) => c !== null && c !== undefined).map(
    (c) => (c instanceof Node ? c : document.createTextNode(String(c)))));
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  node.append(...children);
  return node;
}

const num = (x, digits = 2) => (x === null || x === undefined ? "-" : Number(x).toFixed(digits).replace(/\.?0+$/, "") || "0");
const stateCell = (state) => el("td", { class: `state state-${state}`, "data-state": state }, state);
const fillBody = (table, rows) => document.querySelector(`#${table} tbody`).replaceChildren(...rows);

// -- tables -----------------------------------------------------------------------------

function renderRegions(regions, status) {
  fillBody("regions", regions.map((r) => {
    const s = status.per_region[r.name] || { balancers: {}, replicas: 0, replicas_healthy: 0 };
    const bs = Object.entries(s.balancers).map(([id, st]) => `${id} (${st})`).join(", ") || "none";
    return el("tr", { "data-region": r.name },
      el("td", {}, r.name),
      el("td", {}, `${num(r.latitude, 1)}, ${num(r.longitude, 1)}`),
      el("td", {}, r.cloud_region || "-"),
      el("td", {}, bs),
      el("td", { class: "num" }, `${s.replicas_healthy}/${s.replicas}`),
      el("td", { class: "num" }, num(s.requests_per_s)),
      el("td", { class: "num" }, s.queue_length ?? 0),
      el("td", { class: "num" }, s.in_flight ?? 0));
  }));
}

function renderBalancers(balancers) {
  fillBody("balancers", balancers.map((b) => el("tr", { "data-balancer": b.id },
    el("td", {}, b.id), el("td", {}, b.region), stateCell(b.state || "unknown"),
    el("td", {}, b.policy || "default"), el("td", {}, b.url))));
}

function renderReplicas(replicas) {
  fillBody("replicas", replicas.map((r) => {
    const moved = r.assigned && r.assigned !== r.balancer;
    const assigned = el("td", { "data-assigned": r.assigned || "" }, r.assigned || "none");
    if (moved) assigned.append(" ", el("span", { class: "moved" }, "away from home"));
    return el("tr", { "data-replica": r.id },
      el("td", {}, r.id), el("td", {}, r.model), el("td", {}, r.region), el("td", {}, r.gpu),
      stateCell(r.state || "unknown"), el("td", { "data-home": r.balancer || "" }, r.balancer || "none"),
      assigned, el("td", {}, r.url));
  }));
}

function renderSummary(status) {
  const counts = (d) => Object.entries(d).map(([k, n]) => `${n} ${k}`).join(", ") || "none";
  document.getElementById("summary").textContent =
    `${status.regions} regions · balancers: ${counts(status.balancers)} · ` +
    `replicas: ${counts(status.replicas)} · revision ${status.revision}`;
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// -- charts -----------------------------------------------------------------------------

function regionSeries(samples) {
  // Each balancer reports its own window. A region's value at a report is the sum of its
  // balancers' latest reports, each counted until it is three of its windows old.
  const out = new Map();
  for (const s of samples) {
    if (!out.has(s.region)) out.set(s.region, { latest: new Map(), rps: [], queue: [] });
    const r = out.get(s.region);
    r.latest.set(s.balancer, s);
    let rps = 0;
    let queue = 0;
    for (const [id, x] of r.latest) {
      if (s.ts - x.ts > 3 * x.window_s) { r.latest.delete(id); continue; }
      const requests = Object.values(x.models || {}).reduce((a, m) => a + (m.requests || 0), 0);
      rps += requests / x.window_s;
      queue += x.queue_length || 0;
    }
    r.rps.push([s.ts, rps]);
    r.queue.push([s.ts, queue]);
  }
  return out;
}

const span = (s) => (s < 10 ? `${s.toFixed(1)} s` : s < 120 ? `${Math.round(s)} s` : `${Math.round(s / 60)} min`);

function lineChart(title, series, { width = 280, height = 96 } = {}) {
  // series: [{name, cls, points: [[t, y], ...]}], drawn on one shared scale.
  const pad = { l: 34, r: 6, t: 6, b: 16 };
  const all = series.flatMap((s) => s.points);
  // The x axis spans the data shown (at most CHART_SPAN_S), so a fresh mesh with a few
  // reports gets a readable line rather than a sliver at the right edge.
  const t1 = Math.max(...all.map((p) => p[0]));
  const t0 = Math.min(...all.map((p) => p[0]), t1 - 0.001);
  const ymax = Math.max(1e-9, ...all.map((p) => p[1]));
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (width - pad.l - pad.r);
  const y = (v) => height - pad.b - (v / ymax) * (height - pad.t - pad.b);
  const plot = svg("svg", { class: "chart-svg", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title },
    svg("line", { class: "axis", x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b }),
    svg("line", { class: "axis", x1: pad.l, y1: pad.t, x2: pad.l, y2: height - pad.b }),
    svg("text", { x: pad.l - 4, y: pad.t + 8, "text-anchor": "end" }, num(ymax)),
    svg("text", { x: pad.l - 4, y: height - pad.b, "text-anchor": "end" }, "0"),
    svg("text", { x: pad.l, y: height - 3 }, `last ${span(t1 - t0)}`));
  for (const s of series) {
    if (!s.points.length) continue;
    // One sample still gets a visible mark: a short flat segment ending at it.
    const pts = s.points.length === 1 ? [[s.points[0][0] - (t1 - t0) / 50, s.points[0][1]], s.points[0]] : s.points;
    const d = pts.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join("");
    plot.append(svg("path", { class: `series ${s.cls}`, d, "data-series": s.name }));
  }
  const legend = el("div", { class: "legend" }, ...series.map((s) => el("span", { class: s.name }, `— ${s.name}`)));
  return el("div", { class: "chart" }, el("h3", {}, title), plot, legend);
}

function renderCharts(telemetry) {
  const box = document.getElementById("charts");
  const now = Math.max(...telemetry.map((s) => s.ts));
  const recent = telemetry.filter((s) => now - s.ts <= CHART_SPAN_S);
  if (!recent.length) {
    box.replaceChildren(el("p", { class: "muted" }, "no telemetry yet"));
    return;
  }
  const charts = [];
  for (const [region, r] of [...regionSeries(recent)].sort((a, b) => a[0].localeCompare(b[0]))) {
    const chart = (name, label, points) => {
      const c = lineChart(`${region}: ${label}`, [{ name, cls: `series-${name}`, points }]);
      c.setAttribute("data-chart", `${region}:${name}`);
      return c;
    };
    charts.push(chart("rps", "requests/s", r.rps), chart("queue", "queue length", r.queue));
  }
  box.replaceChildren(...charts);
}

function renderForecast(forecast) {
  // Expected shape: {"series": [{"model", "region", "metric", "points":
  // [{"ts", "forecast", "actual"}]}]} (a bare list of series works too).
  const box = document.getElementById("forecast");
  const list = forecast === null ? [] : Array.isArray(forecast) ? forecast : forecast.series || [];
  if (!list.length) {
    box.replaceChildren(el("p", { class: "muted", id: "no-forecast" }, "no forecast yet"));
    return;
  }
  box.replaceChildren(...list.map((s) => {
    const pts = (key) => (s.points || []).filter((p) => typeof p[key] === "number").map((p) => [p.ts, p[key]]);
    const title = [s.model, s.region, s.metric].filter(Boolean).join(" · ") || "forecast";
    return lineChart(title, [
      { name: "forecast", cls: "series-forecast", points: pts("forecast") },
      { name: "actual", cls: "series-actual", points: pts("actual") },
    ]);
  }));
}

// -- polling and login ------------------------------------------------------------------

let timer = null;

function showError(message) {
  const p = document.getElementById("error");
  p.hidden = !message;
  p.textContent = message || "";
}

function showLogin(message) {
  clearTimeout(timer);
  document.getElementById("mesh").hidden = true;
  document.getElementById("forget").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("summary").textContent = "not connected";
  document.getElementById("token").focus();
}

async function poll() {
  try {
    const [status, regions, balancers, replicas, telemetry, forecast] = await Promise.all([
      api("/v1/status"), api("/v1/regions"), api("/v1/balancers"), api("/v1/replicas"),
      api(`/v1/telemetry?limit=${TELEMETRY_LIMIT}`), api("/v1/forecast", { missingOk: true }),
    ]);
    document.getElementById("login").hidden = true;
    document.getElementById("mesh").hidden = false;
    document.getElementById("forget").hidden = false;
    renderSummary(status);
    renderRegions(regions, status);
    renderBalancers(balancers);
    renderReplicas(replicas);
    renderCharts(telemetry);
    renderForecast(forecast);
    showError(null);
  } catch (e) {
    if (e instanceof Unauthorized) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin(`token rejected (${e.message})`);
      return;
    }
    // Keep the last good view and say it is stale; the next round may succeed.
    showError(`cannot update: ${e.message}`);
  }
  timer = setTimeout(poll, POLL_MS);
}

function start() {
  clearTimeout(timer);
  if (token()) poll();
  else showLogin("");
}

document.addEventListener("DOMContentLoaded", () => {
  tokenFromFragment();
  document.getElementById("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
    document.getElementById("token").value = "";
    start();
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin("");
  });
  start();
});
