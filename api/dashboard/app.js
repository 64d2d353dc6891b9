// backfill dashboard: plain script, no build step. Reads the JSON routes with the key the user
// entered (kept in sessionStorage, sent as a Bearer token) and draws with DOM and inline SVG.
// Every value from the server goes in as text (textContent), never as markup.
"use strict";

const KEY_ITEM = "backfill.apiKey";
const SAMPLE_EVERY_MS = 2000;
const BATCHES_EVERY_MS = 3000;
const USAGE_EVERY_MS = 30000;
const SAMPLES_KEPT = 180; // six minutes at one sample every 2 s
const MIN_SPAN_S = 30;
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
const samples = [];
const timers = [];
let teamNames = new Map();

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

const fmt = new Intl.NumberFormat("en-US");
const when = new Intl.DateTimeFormat(undefined, { dateStyle: "short", timeStyle: "medium" });
const money = new Intl.NumberFormat("en-US", { style: "currency", currency: "USD", maximumFractionDigits: 4 });

class Unauthorized extends Error {}

async function api(path) {
  const key = sessionStorage.getItem(KEY_ITEM);
  const response = await fetch(path, { headers: { Authorization: "Bearer " + key }, cache: "no-store" });
  if (response.status === 401) throw new Unauthorized("The key was refused.");
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function showError(err) {
  if (err instanceof Unauthorized) {
    signOut(err.message);
    return;
  }
  const node = $("error");
  node.textContent = String(err.message || err);
  node.hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

// -- Batches ----------------------------------------------------------------------------------

function progressCell(b) {
  const total = b.total || 0;
  const done = b.completed + b.failed;
  const pct = total ? Math.floor((100 * done) / total) : 0;
  const bar = el("div", { class: "bar" });
  const ok = el("div", { class: "done" });
  ok.style.width = (total ? (100 * b.completed) / total : 0) + "%";
  const bad = el("div", { class: "failed" });
  bad.style.left = ok.style.width;
  bad.style.width = (total ? (100 * b.failed) / total : 0) + "%";
  bar.append(ok, bad);
  let text = total ? `${fmt.format(done)}/${fmt.format(total)} (${pct}%)` : "–";
  if (b.failed) text += ` · ${fmt.format(b.failed)} failed`;
  const cell = el("td", { class: "progress-col" });
  const wrap = el("div", { class: "progress" });
  wrap.append(bar, el("span", { class: "progress-text" }, text));
  cell.append(wrap);
  return cell;
}

function renderBatches(page) {
  document.body.classList.toggle("admin", page.admin);
  teamNames = new Map(page.teams.map((t) => [t.project_id, t.name]));
  const me = teamNames.get(page.project_id) || page.project_id;
  $("who").textContent = page.admin ? `admin key (team ${me}): all teams` : `team ${me}`;
  const body = $("batches").tBodies[0];
  body.replaceChildren(
    ...page.data.map((b) => {
      const row = el("tr", { "data-batch": b.id });
      row.append(
        el("td", { class: "id" }, b.id),
        el("td", { class: "team-col" }, teamNames.get(b.project_id) || b.project_id),
      );
      const status = el("td");
      status.append(el("span", { class: "status " + b.status }, b.status.replace("_", " ")));
      row.append(
        status,
        el("td", {}, b.model || "–"),
        progressCell(b),
        el("td", { class: "num" }, `${fmt.format(b.input_tokens)} / ${fmt.format(b.output_tokens)}`),
        el("td", {}, when.format(new Date(b.created_at * 1000))),
      );
      return row;
    }),
  );
  $("no-batches").hidden = page.data.length > 0;
  $("batches-updated").textContent = "updated " + new Date().toLocaleTimeString();
}

async function refreshBatches() {
  try {
    renderBatches(await api("/v1/dashboard/batches"));
    clearError();
  } catch (err) {
    showError(err);
  }
}

// -- Fleet load -------------------------------------------------------------------------------

const W = 760, H = 240, PAD = { l: 44, r: 12, t: 12, b: 26 };

function renderChart() {
  const box = $("chart");
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "fleet load over time" });
  const n = samples.length;
  const top = Math.max(4, ...samples.map((s) => Math.max(s.fleet_inflight ?? 0, s.batch_inflight ?? 0, s.limit ?? 0)));
  const yMax = Math.ceil(top * 1.15);
  // Time runs left to right over what was sampled (at least MIN_SPAN_S), the newest at the right.
  const newest = n ? samples[n - 1].at : 0;
  const span = Math.max(MIN_SPAN_S, n ? newest - samples[0].at : 0);
  const xAt = (t) => W - PAD.r - ((newest - t) * (W - PAD.l - PAD.r)) / span;
  const x = (i) => xAt(samples[i].at);
  const y = (v) => H - PAD.b - (v * (H - PAD.t - PAD.b)) / yMax;

  for (const frac of [0, 0.5, 1]) {
    const v = Math.round(yMax * frac);
    plot.append(svg("line", { class: "axis", x1: PAD.l, x2: W - PAD.r, y1: y(v), y2: y(v) }));
    plot.append(svg("text", { class: "label", x: PAD.l - 6, y: y(v) + 4, "text-anchor": "end" }, String(v)));
  }
  plot.append(svg("text", { class: "label", x: PAD.l, y: H - 6 }, `${Math.round(span)} s ago`));
  plot.append(svg("text", { class: "label", x: W - PAD.r, y: H - 6, "text-anchor": "end" }, "now"));

  if (n) {
    const batch = samples.map((s) => s.batch_inflight ?? 0);
    const fleet = samples.map((s, i) => Math.max(s.fleet_inflight ?? batch[i], batch[i]));
    const area = (upper, lower) =>
      upper.map((v, i) => `${x(i)},${y(v)}`).join(" ") + " " +
      lower.map((v, i) => `${x(i)},${y(v)}`).reverse().join(" ");
    plot.append(svg("polygon", { class: "area-interactive", points: area(fleet, batch) }));
    plot.append(svg("polygon", { class: "area-batch", points: area(batch, batch.map(() => 0)) }));
    const limit = samples.map((s, i) => (s.limit === null ? null : `${x(i)},${y(s.limit)}`)).filter(Boolean);
    plot.append(svg("polyline", { class: "line-limit", points: limit.join(" ") }));
  }
  const cursor = svg("line", { class: "cursor", y1: PAD.t, y2: H - PAD.b, visibility: "hidden" });
  plot.append(cursor);
  const tip = el("div", { class: "tooltip" });
  tip.hidden = true;

  plot.addEventListener("mousemove", (event) => {
    if (!n) return;
    const rect = plot.getBoundingClientRect();
    const px = ((event.clientX - rect.left) * W) / rect.width;
    const t = newest - ((W - PAD.r - px) * span) / (W - PAD.l - PAD.r);
    let i = 0;
    for (let j = 1; j < n; j++) if (Math.abs(samples[j].at - t) < Math.abs(samples[i].at - t)) i = j;
    const s = samples[i];
    cursor.setAttribute("x1", x(i));
    cursor.setAttribute("x2", x(i));
    cursor.setAttribute("visibility", "visible");
    tip.textContent =
      `${new Date(s.at * 1000).toLocaleTimeString()} · fleet ${s.fleet_inflight ?? "?"}` +
      ` · interactive ${s.interactive_inflight ?? "?"} · batch ${s.batch_inflight ?? "?"} · limit ${s.limit ?? "?"}`;
    tip.hidden = false;
    tip.style.left = Math.min(event.clientX - rect.left + 12, rect.width - 260) + "px";
    tip.style.top = "8px";
  });
  plot.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    tip.hidden = true;
  });
  box.replaceChildren(plot, tip);
}

function renderFleetNow(s) {
  // Leases are held a moment longer than the fleet holds the request: the share never passes 100%.
  const batch = s.batch_inflight ?? 0;
  const busy = Math.max(s.fleet_inflight ?? 0, batch);
  const share = s.fleet_inflight === null ? "–" : busy ? Math.round((100 * batch) / busy) + "%" : "0%";
  const stat = (label, value) => {
    const node = el("div");
    node.append(el("b", {}, value === null || value === undefined ? "–" : String(value)), el("span", { class: "muted" }, label));
    return node;
  };
  $("fleet-now").replaceChildren(
    stat("fleet in flight", s.fleet_inflight),
    stat("interactive", s.interactive_inflight),
    stat("batch (leases held)", s.batch_inflight),
    stat(s.capacity_control ? "released limit (controlled)" : "released limit (fixed)", s.limit),
    stat("batch share", share),
  );
  // Capacity per pool: a deployment's, or each model's where a deployment serves several.
  const show = (v) => (v === null || v === undefined ? "–" : String(v));
  $("pools").querySelector("tbody").replaceChildren(
    ...(s.pools ?? []).map((p) => {
      const row = el("tr");
      row.append(
        el("td", {}, p.pool),
        el("td", {}, p.model ?? "(all)"),
        el("td", {}, p.deployment),
        el("td", { class: "num" }, show(p.fleet_inflight)),
        el("td", { class: "num" }, show(p.batch_inflight)),
        el("td", { class: "num" }, show(p.limit)),
      );
      return row;
    }),
  );
}

async function sampleFleet() {
  try {
    const s = await api("/v1/dashboard/fleet");
    samples.push(s);
    if (samples.length > SAMPLES_KEPT) samples.shift();
    renderFleetNow(s);
    renderChart();
  } catch (err) {
    showError(err);
  }
}

// -- Usage and cost ---------------------------------------------------------------------------

async function refreshUsage() {
  const start = Math.floor(Date.now() / 1000) - 7 * 86400;
  try {
    const [usage, costs] = await Promise.all([
      api(`/v1/organization/usage/completions?start_time=${start}&bucket_width=1d&limit=8&group_by=project_id,model`),
      api(`/v1/organization/costs?start_time=${start}&bucket_width=1d&limit=8&group_by=project_id,line_item`),
    ]);
    const rows = new Map();
    const row = (project, model) => {
      const k = project + "\u0000" + model;
      if (!rows.has(k)) rows.set(k, { project, model, requests: 0, input: 0, cached: 0, output: 0, cost: 0 });
      return rows.get(k);
    };
    for (const bucket of usage.data) {
      for (const r of bucket.results) {
        const t = row(r.project_id, r.model);
        t.requests += r.num_model_requests;
        t.input += r.input_tokens;
        t.cached += r.input_cached_tokens;
        t.output += r.output_tokens;
      }
    }
    for (const bucket of costs.data) {
      for (const r of bucket.results) {
        // A line item is "<model>, input|cached input|output".
        const model = (r.line_item || "").replace(/, (input|cached input|output)$/, "");
        row(r.project_id, model).cost += r.amount.value;
      }
    }
    const sorted = [...rows.values()].sort((a, b) => b.cost - a.cost || b.requests - a.requests);
    $("usage").tBodies[0].replaceChildren(
      ...sorted.map((t) => {
        const tr = el("tr");
        tr.append(
          el("td", { class: "team-col" }, teamNames.get(t.project) || t.project),
          el("td", {}, t.model),
          el("td", { class: "num" }, fmt.format(t.requests)),
          el("td", { class: "num" }, fmt.format(t.input)),
          el("td", { class: "num" }, fmt.format(t.cached)),
          el("td", { class: "num" }, fmt.format(t.output)),
          el("td", { class: "num" }, money.format(t.cost)),
        );
        return tr;
      }),
    );
    $("no-usage").hidden = sorted.length > 0;
  } catch (err) {
    showError(err);
  }
}

// -- Key and timers ---------------------------------------------------------------------------

function every(fn, ms) {
  fn();
  timers.push(setInterval(fn, ms));
}

function start() {
  $("key-form").hidden = true;
  $("board").hidden = false;
  $("sign-out").hidden = false;
  refreshBatches().then(() => every(refreshUsage, USAGE_EVERY_MS));
  timers.push(setInterval(refreshBatches, BATCHES_EVERY_MS));
  every(sampleFleet, SAMPLE_EVERY_MS);
}

function signOut(message) {
  while (timers.length) clearInterval(timers.pop());
  sessionStorage.removeItem(KEY_ITEM);
  samples.length = 0;
  $("board").hidden = true;
  $("sign-out").hidden = true;
  $("key-form").hidden = false;
  $("who").textContent = "";
  const err = $("key-error");
  err.textContent = message || "";
  err.hidden = !message;
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    $("api-key").value = "";
    $("key-error").hidden = true;
    start();
  });
  $("sign-out").addEventListener("click", () => signOut());
  if (sessionStorage.getItem(KEY_ITEM)) start();
});
