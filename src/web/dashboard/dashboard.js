// The cluster, live: /api/nbos/live sends a snapshot (cluster view and history) and then one
// tick a second. The token comes from ?token= on the page's URL (kept for this tab only).
import { html, render, useEffect, useState } from './vendor/preact-htm.js';
import { Chart } from './charts.js';

const base = location.pathname.replace(/\/dashboard\/?$/, '');
const params = new URLSearchParams(location.search);
if (params.get('token')) sessionStorage.setItem('nbos-token', params.get('token'));
const token = sessionStorage.getItem('nbos-token') || '';
const MAX_SAMPLES = 900;
const COLUMNS = ['at_unix_ms', 'gpus_provisioned', 'gpus_committed', 'gpus_subscribed', 'kernels',
  'cells_waiting', 'executions', 'delay_p50_ms', 'delay_p95_ms', 'delay_p99_ms'];

function feedUrl() {
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${proto}//${location.host}${base}/api/nbos/live?token=${encodeURIComponent(token)}`;
}

function appendSample(history, sample) {
  const next = {};
  for (const c of COLUMNS) {
    const col = (history[c] || []).concat([sample[c] ?? null]);
    next[c] = col.length > MAX_SAMPLES ? col.slice(col.length - MAX_SAMPLES) : col;
  }
  return next;
}

function useFeed() {
  const [state, setState] = useState({ cluster: null, history: null, live: false, error: '' });
  useEffect(() => {
    let ws, retry, closed = false;
    const connect = () => {
      ws = new WebSocket(feedUrl());
      ws.onmessage = (m) => {
        const msg = JSON.parse(m.data);
        setState((s) => msg.type === 'snapshot'
          ? { cluster: msg.cluster, history: msg.history, live: true, error: '' }
          : { ...s, cluster: msg.cluster, history: appendSample(s.history || {}, msg.sample), live: true });
      };
      ws.onclose = (e) => {
        if (closed) return;
        setState((s) => ({ ...s, live: false,
          error: e.code === 1006 && !s.cluster ? 'cannot connect (is the token right? open this page as /dashboard?token=…)' : '' }));
        retry = setTimeout(connect, 2000);
      };
    };
    connect();
    return () => { closed = true; clearTimeout(retry); ws && ws.close(); };
  }, []);
  return state;
}

function Gpus({ total, committed }) {
  const cells = [];
  for (let i = 0; i < total; i++) cells.push(html`<span class=${'gpu' + (i < committed ? ' committed' : '')}></span>`);
  return html`<span class="gpus">${cells}</span>`;
}

function Servers({ servers }) {
  return html`<section><h2>Servers</h2><table data-testid="servers">
    <tr><th>server</th><th>state</th><th>GPUs (committed / all)</th><th>idle</th><th>subscribed</th>
      <th>ratio</th><th>warm pool</th></tr>
    ${servers.map((s) => html`<tr data-server=${s.server_id} data-gpus-committed=${s.gpus_committed}>
      <td>${s.server_id}<br/><code>${s.address}</code></td>
      <td>${!s.alive ? 'lost' : s.draining ? 'draining' : 'up'}</td>
      <td><${Gpus} total=${s.spec.gpus} committed=${s.gpus_committed}/>${s.gpus_committed} / ${s.spec.gpus}</td>
      <td>${s.gpus_idle}</td><td>${s.subscribed.gpus}</td><td>${(s.subscription_ratio ?? 0).toFixed(2)}</td>
      <td>${s.warm_pool && s.warm_pool.target !== undefined ? `${s.warm_pool.ready} / ${s.warm_pool.target}` : '-'}</td>
    </tr>`)}
  </table></section>`;
}

function kernelState(k) {
  if (k.suspended) return 'suspended';
  if (k.cell_waiting) return 'waiting';
  return k.execution_state;
}

function Kernels({ kernels }) {
  if (!kernels.length) return html`<section><h2>Kernels</h2><p class="note">No kernels.</p></section>`;
  return html`<section><h2>Kernels</h2><table data-testid="kernels">
    <tr><th>kernel</th><th>owner</th><th>state</th><th>GPUs / cell</th><th>replicas</th><th>migration</th></tr>
    ${kernels.map((k) => html`<tr data-kernel=${k.id} data-state=${kernelState(k)}>
      <td><code title=${k.id}>${k.id.slice(0, 8)}</code> ${k.name}</td>
      <td>${k.owner || '-'}</td>
      <td class=${'state-' + kernelState(k)}>${kernelState(k)}</td>
      <td>${k.resources ? k.resources.gpus : '-'}</td>
      <td>${k.replicas.map((r) => html`<span class=${'chip ' + r.state + (r.role === 'executor' ? ' executor' : '')}
          title=${`${r.state}, process ${r.process_state}, pid ${r.pid}`}>
          ${r.replica_id}@${r.server_id}${k.executing_replica === r.replica_id ? ' ▶' : ''}</span>`)}</td>
      <td>${k.migration ? `replica ${k.migration.leaving_replica} → ${k.migration.to_server_id} (${k.migration.reason})` : ''}</td>
    </tr>`)}
  </table></section>`;
}

function Events({ events }) {
  const shown = [...events].reverse();
  return html`<section><h2>Events</h2><div class="events"><table data-testid="events">
    ${shown.length === 0 ? html`<tr><td class="note">Nothing has happened yet.</td></tr>` : ''}
    ${shown.map((e) => html`<tr data-kind=${e.kind}>
      <td>${new Date(e.at_unix_ms).toLocaleTimeString()}</td><td class="kind">${e.kind}</td>
      <td><code>${(e.kernel_id || '').slice(0, 8)}</code></td><td>${e.text}</td></tr>`)}
  </table></div></section>`;
}

function Charts({ history }) {
  const t = (history.at_unix_ms || []).map((ms) => ms / 1000);
  return html`<section><h2>Over time</h2><div class="charts">
    <${Chart} title="GPUs" testid="chart-gpus"
      series=${[{ label: 'provisioned', stroke: '#656d76' }, { label: 'committed', stroke: '#bf8700' },
                { label: 'subscribed', stroke: '#0969da', dash: [4, 4] }]}
      data=${[t, history.gpus_provisioned, history.gpus_committed, history.gpus_subscribed]}/>
    <${Chart} title="Interactivity delay (ms, last minute)" testid="chart-delay"
      series=${[{ label: 'p50', stroke: '#1a7f37' }, { label: 'p95', stroke: '#bf8700' },
                { label: 'p99', stroke: '#cf222e' }]}
      data=${[t, history.delay_p50_ms, history.delay_p95_ms, history.delay_p99_ms]}/>
    <${Chart} title="Cells waiting for GPUs" testid="chart-waiting"
      series=${[{ label: 'waiting', stroke: '#cf222e' }, { label: 'kernels', stroke: '#656d76' }]}
      data=${[t, history.cells_waiting, history.kernels]}/>
  </div></section>`;
}

function App() {
  const { cluster, history, live, error } = useFeed();
  if (!cluster) return html`<p class=${error ? 'error' : 'note'}>${error || 'Connecting…'}</p>`;
  const alive = cluster.servers.filter((s) => s.alive);
  const total = alive.reduce((n, s) => n + s.spec.gpus, 0);
  const committed = alive.reduce((n, s) => n + s.gpus_committed, 0);
  return html`
    <header>
      <h1>nbos</h1>
      <span class="stat" data-testid="summary-servers"><b>${alive.length}</b> servers</span>
      <span class="stat" data-testid="summary-gpus"><b>${committed} / ${total}</b> GPUs committed</span>
      <span class="stat"><b>${cluster.kernels.length}</b> kernels</span>
      <span class="stat" title="SR_c: GPUs the kernels ask for over GPUs running cells, averaged over the last samples; at its cap while nothing runs">
        demand / busy GPUs <b>${(cluster.cluster_subscription_ratio ?? 0).toFixed(2)}</b></span>
      ${cluster.pending_servers && cluster.pending_servers.length
        ? html`<span class="stat">starting: ${cluster.pending_servers.join(', ')}</span>` : ''}
      <a href=${`${base}/dashboard/sim`}>simulation reports</a>
      <span class=${'live ' + (live ? 'on' : 'off')} data-testid="live">${live ? 'live' : 'reconnecting…'}</span>
    </header>
    <main>
      <${Servers} servers=${cluster.servers}/>
      <${Kernels} kernels=${cluster.kernels}/>
      <${Charts} history=${history || {}}/>
      <${Events} events=${cluster.events || []}/>
    </main>`;
}

const app = document.getElementById('app');
app.textContent = '';  // the placeholder shown until this script runs
render(html`<${App}/>`, app);
