// Drives a gateway with JupyterLab's client library: start a kernel, execute, interrupt a long
// cell, execute again, shut down. Prints one JSON line per step; exits non-zero on failure.
// Usage: node lab_client.mjs BASE_URL TOKEN
import { KernelManager, ServerConnection } from '@jupyterlab/services';
import WebSocket from 'ws';

const [baseUrl, token] = process.argv.slice(2);
const serverSettings = ServerConnection.makeSettings({
  baseUrl,
  wsUrl: baseUrl.replace(/^http/, 'ws'),
  token,
  WebSocket,
  appendToken: true,
});
const log = (step, data) => console.log(JSON.stringify({ step, ...data }));

async function execute(kernel, code) {
  const outputs = [];
  const future = kernel.requestExecute({ code });
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream') outputs.push(msg.content.text);
    if (msg.header.msg_type === 'execute_result') outputs.push(msg.content.data['text/plain']);
  };
  const reply = await future.done;
  return { status: reply.content.status, ename: reply.content.ename, outputs,
           execution_count: reply.content.execution_count };
}

const manager = new KernelManager({ serverSettings });
await manager.ready;
const kernel = await manager.startNew({ name: 'nbos' });
log('started', { id: kernel.id, name: kernel.name });
const info = await kernel.info;
log('info', { implementation: info.implementation, language: info.language_info.name });
log('execute', await execute(kernel, 'x = 6 * 7\nprint("hi")\nx'));
const long = execute(kernel, 'import time\nfor _ in range(600): time.sleep(0.1)');
await new Promise((r) => setTimeout(r, 1500));
const interruptedAt = Date.now();
await kernel.interrupt();
const interrupted = await long;
log('interrupted', { ...interrupted, seconds: (Date.now() - interruptedAt) / 1000 });
log('after', await execute(kernel, 'x + 1'));
await kernel.shutdown();
await manager.refreshRunning();
const running = [];
for (const model of manager.running()) running.push(model.id);
log('shutdown', { still_listed: running.includes(kernel.id) });
manager.dispose();
process.exit(0);
