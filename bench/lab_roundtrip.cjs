// The empty-cell round trip with JupyterLab's own client library (@jupyterlab/services, from
// tests/jupyterlab's npm install) instead of gateway_bench.py's websocket-client: it connects to
// already started kernels and runs `pass` on each in turn (rotating which goes first), timing
// requestExecute -> the future done (execute_reply and iopub idle). Prints one JSON object:
// {"LABEL": [ms, ...], ...}, warm-up cells left out.
// Usage: node lab_roundtrip.cjs LAB_DIR N WARMUP JSON-LIST-OF-{label,url,token,kernel_id} [TIMEOUT_S]
// A connection without kernel_info_reply, or a cell, that has not finished within TIMEOUT_S (60)
// fails the run, naming its kernel.
const path = require('path');
const [labDir, n, warmup, targetsJson, timeoutS = '60'] = process.argv.slice(2);
const { KernelManager, ServerConnection } = require(path.join(labDir, 'node_modules', '@jupyterlab', 'services'));
const WebSocket = require(path.join(labDir, 'node_modules', 'ws'));

async function connect(t) {
  const serverSettings = ServerConnection.makeSettings({
    baseUrl: t.url, wsUrl: t.url.replace(/^http/, 'ws'), token: t.token, WebSocket, appendToken: true,
  });
  const manager = new KernelManager({ serverSettings });
  await manager.ready;
  const kernel = manager.connectTo({ model: { id: t.kernel_id, name: 'python3' } });
  let timer;
  const late = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(
      `${t.label}: no kernel_info_reply within ${timeoutS} s of connecting`)),
    Number(timeoutS) * 1000);
  });
  await Promise.race([kernel.info, late]);
  clearTimeout(timer);
  return { manager, kernel };
}

(async () => {
  const targets = JSON.parse(targetsJson);
  const conns = [];
  for (const t of targets) conns.push(await connect(t));
  const times = Object.fromEntries(targets.map((t) => [t.label, []]));
  const total = Number(n) + Number(warmup);
  for (let i = 0; i < total; i++) {
    for (let j = 0; j < targets.length; j++) {
      const k = (i + j) % targets.length;
      const start = process.hrtime.bigint();
      let timer;
      const late = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(
          `cell ${i} on ${targets[k].label}: no execute_reply and idle within ${timeoutS} s`)),
        Number(timeoutS) * 1000);
      });
      await Promise.race([conns[k].kernel.requestExecute({ code: 'pass' }).done, late]);
      clearTimeout(timer);
      const ms = Number(process.hrtime.bigint() - start) / 1e6;
      if (i >= Number(warmup)) times[targets[k].label].push(ms);
    }
  }
  for (const c of conns) { c.kernel.dispose(); c.manager.dispose(); }
  console.log(JSON.stringify(times));
  process.exit(0);
})().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
