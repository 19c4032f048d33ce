// A `nbos sim report` run's results.json, chosen by the user (it is read here, in the browser):
// a table per policy and idle-reclamation setting, interactivity delay and task completion CDFs,
// and servers over time.
import { html, render, useState } from './vendor/preact-htm.js';
import { Chart } from './charts.js';

const COLORS = ['#0969da', '#bf8700', '#1a7f37', '#cf222e', '#8250df', '#656d76', '#1b7c83', '#953800'];
const label = (r) => r.policy + (r.idle_reclaim_min ? ` (idle ${r.idle_reclaim_min} min)` : '');
const fmt = (v, digits = 1) => (typeof v === 'number' ? v.toFixed(digits) : '-');

function parse(text) {
  const results = JSON.parse(text);
  if (!Array.isArray(results) || !results.every((r) => r && typeof r.policy === 'string')) {
    throw new Error('not a results.json of nbos sim report (an array of results with a policy each)');
  }
  return results;
}

function Table({ results }) {
  return html`<table data-testid="sim-table">
    <tr><th>policy</th><th>sessions</th><th>cells</th><th>GPU-hours provisioned</th><th>committed</th>
      <th>immediate %</th><th>delay p50 / p90 / p99 (s)</th><th>migrations</th><th>peak servers</th>
      <th>cost (USD)</th></tr>
    ${results.map((r) => html`<tr data-policy=${label(r)}>
      <td>${label(r)}</td><td>${r.sessions}</td><td>${r.cells}</td>
      <td>${fmt(r.gpu_hours_provisioned)}</td><td>${fmt(r.gpu_hours_committed)}</td>
      <td>${fmt(r.pct_immediate)}</td>
      <td>${r.delay_s ? `${fmt(r.delay_s.p50, 2)} / ${fmt(r.delay_s.p90, 2)} / ${fmt(r.delay_s.p99, 2)}` : '-'}</td>
      <td>${r.migrations}</td><td>${r.peak_servers}</td><td>${fmt(r.provider_cost_usd, 0)}</td></tr>`)}
  </table>`;
}

function Cdf({ results, field, title, testid }) {
  // x: the percentile; one series per run.
  const pct = Array.from({ length: 101 }, (_, i) => i);
  const shown = results.filter((r) => Array.isArray(r[field]) && r[field].length === 101);
  return html`<${Chart} title=${title} x="percentile" testid=${testid}
    series=${shown.map((r, i) => ({ label: label(r), stroke: COLORS[i % COLORS.length] }))}
    data=${[pct, ...shown.map((r) => r[field])]}/>`;
}

function Servers({ results }) {
  const runs = results.filter((r) => !r.idle_reclaim_min && Array.isArray(r.servers_over_time));
  const hours = [...new Set(runs.flatMap((r) => r.servers_over_time.map(([h]) => h)))].sort((a, b) => a - b);
  const column = (r) => {
    const at = new Map(r.servers_over_time.map(([h, n]) => [h, n]));
    return hours.map((h) => (at.has(h) ? at.get(h) : null));
  };
  return html`<${Chart} title="Servers (most in each hour)" x="hour" testid="sim-servers"
    series=${runs.map((r, i) => ({ label: label(r), stroke: COLORS[i % COLORS.length] }))}
    data=${[hours, ...runs.map(column)]}/>`;
}

function App() {
  const [state, setState] = useState({ results: null, name: '', error: '' });
  const load = async (e) => {
    const file = e.target.files[0];
    if (!file) return;
    try {
      setState({ results: parse(await file.text()), name: file.name, error: '' });
    } catch (err) {
      setState({ results: null, name: file.name, error: `${file.name}: ${err.message}` });
    }
  };
  return html`
    <header><h1>nbos simulation report</h1><a href="../dashboard">cluster dashboard</a></header>
    <main>
      <section>
        <p>Choose the <code>results.json</code> that <code>nbos sim report --trace … --out DIR</code> wrote
          into DIR.</p>
        <input type="file" accept=".json,application/json" onChange=${load} data-testid="sim-file"/>
        ${state.error ? html`<p class="error" data-testid="sim-error">${state.error}</p>` : ''}
      </section>
      ${state.results ? html`
        <section><h2>${state.name}: ${state.results.length} runs</h2><${Table} results=${state.results}/></section>
        <section class="charts">
          <${Cdf} results=${state.results} field="delay_cdf_s" title="Interactivity delay (s) by percentile" testid="sim-delay"/>
          <${Cdf} results=${state.results} field="tct_cdf_s" title="Task completion time (s) by percentile" testid="sim-tct"/>
          <${Servers} results=${state.results}/>
        </section>` : ''}
    </main>`;
}

const app = document.getElementById('app');
app.textContent = '';  // the placeholder shown until this script runs
render(html`<${App}/>`, app);
