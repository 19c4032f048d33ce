// Drives Debian's Chromium with puppeteer-core for tests/browser/test_browser.py. One scenario
// per run: `node browser.cjs SCENARIO JSON-ARGS`. It prints progress lines ("step NAME") that the
// test waits for, takes screenshots into args.shots, and exits non-zero with the reason when a
// step fails. Lines read from stdin ("go") let the test act between steps.
const puppeteer = require('puppeteer-core');
const path = require('path');
const readline = require('readline');

const [scenario, rawArgs] = process.argv.slice(2);
const args = JSON.parse(rawArgs);
const lines = readline.createInterface({ input: process.stdin });
const waiters = [];
const received = [];
lines.on('line', (l) => { const w = waiters.shift(); if (w) w(l); else received.push(l); });
const fromTest = () => new Promise((resolve) => {
  if (received.length) resolve(received.shift()); else waiters.push(resolve);
});
const step = (name) => console.log(`step ${name}`);

async function shot(page, name) {
  await page.screenshot({ path: path.join(args.shots, `${name}.png`), fullPage: true });
}

async function watch(page) {
  page.on('pageerror', (e) => console.log(`pageerror ${e.message}`));
  page.on('console', (m) => { if (m.type() === 'error') console.log(`console-error ${m.text()}`); });
  await page.setViewport({ width: 1280, height: 900 });
}

// Notebook 6: a new python3 notebook from the tree page, two cells typed and run from the
// toolbar, their outputs (text and a matplotlib PNG) on the page, then saved.
async function notebook(browser) {
  const tree = await browser.newPage();
  await watch(tree);
  await tree.goto(`${args.frontend}/tree?token=${args.token}`, { waitUntil: 'networkidle2' });
  await tree.waitForSelector('#new-dropdown-button');
  await shot(tree, 'notebook-1-tree');
  await tree.click('#new-dropdown-button');
  await tree.waitForSelector('#kernel-python3 a', { visible: true });
  const opened = browser.waitForTarget((t) => t.url().includes('/notebooks/'), { timeout: 60000 });
  await tree.click('#kernel-python3 a');
  const page = await (await opened).page();
  await watch(page);
  await page.waitForFunction(
    () => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel &&
          Jupyter.notebook.kernel.is_connected() && Jupyter.notebook.kernel.info_reply &&
          Jupyter.notebook.kernel.info_reply.status === 'ok', { timeout: 120000 });
  step('kernel-ready');
  const cells = ['print(sum(range(10)))',
    'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("nbos")\nplt.show()'];
  for (const source of cells) {
    await page.evaluate((s) => Jupyter.notebook.get_selected_cell().set_text(s), source);
    await page.click('button[data-jupyter-action="jupyter-notebook:run-cell-and-select-next"]');
  }
  await page.waitForFunction(() => {
    const text = [...document.querySelectorAll('.output_subarea.output_text pre')].map((e) => e.textContent);
    return text.some((t) => t.trim() === '45') && document.querySelector('.output_png img') !== null;
  }, { timeout: 180000 });
  await page.waitForFunction(() => Jupyter.notebook.kernel_busy === false || !document.querySelector('#kernel_indicator_icon.kernel_busy_icon'));
  step('outputs-shown');
  await shot(page, 'notebook-2-outputs');
  const name = await page.evaluate(async () => {
    await Jupyter.notebook.save_notebook();
    return Jupyter.notebook.notebook_path;
  });
  console.log(`saved ${name}`);
}

// The dashboard: the servers and the kernel appear; a cell's GPUs show as committed while it
// runs; a migration appears among the events.
async function dashboard(browser) {
  const page = await browser.newPage();
  await watch(page);
  await page.goto(`${args.gateway}/dashboard?token=${args.token}`, { waitUntil: 'load' });
  await page.waitForFunction((n) => document.querySelectorAll('tr[data-server]').length === n,
    { timeout: 30000 }, args.servers);
  await page.waitForSelector(`tr[data-kernel="${args.kernel}"]`, { timeout: 30000 });
  await page.waitForSelector('[data-testid=chart-gpus] canvas');
  step('dashboard-ready');
  await shot(page, 'dashboard-1-cluster');
  await fromTest();  // the test starts a cell that takes GPUs
  await page.waitForSelector('tr[data-server]:not([data-gpus-committed="0"])', { timeout: 60000 });
  await page.waitForSelector(`tr[data-kernel="${args.kernel}"][data-state="busy"]`, { timeout: 30000 });
  step('gpus-committed');
  await shot(page, 'dashboard-2-gpus-committed');
  await fromTest();  // the test asks for a migration
  await page.waitForSelector('tr[data-kind="migration-done"]', { timeout: 120000 });
  step('migration-shown');
  await shot(page, 'dashboard-3-migration');
  const samples = await page.evaluate(() => document.querySelectorAll('[data-testid=chart-delay] canvas').length);
  if (samples !== 1) throw new Error('the delay chart is missing');
}

// The simulation page with a results.json from `nbos sim report`.
async function sim(browser) {
  const page = await browser.newPage();
  await watch(page);
  await page.goto(`${args.gateway}/dashboard/sim?token=${args.token}`, { waitUntil: 'load' });
  const input = await page.waitForSelector('[data-testid=sim-file]');
  await input.uploadFile(args.results);
  await page.waitForSelector('[data-testid=sim-table] tr[data-policy]');
  await page.waitForSelector('[data-testid=sim-delay] canvas');
  const policies = await page.$$eval('[data-testid=sim-table] tr[data-policy]',
    (rows) => rows.map((r) => r.getAttribute('data-policy')));
  console.log(`policies ${JSON.stringify(policies)}`);
  await shot(page, 'sim-report');
}

(async () => {
  const browser = await puppeteer.launch({
    executablePath: args.chromium, headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run'],
  });
  try {
    await { notebook, dashboard, sim }[scenario](browser);
    step('done');
  } finally {
    await browser.close();
    lines.close();
  }
})().catch((e) => { console.log(`failed ${e.stack || e}`); process.exit(1); });
