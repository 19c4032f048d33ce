// A uPlot line chart as a Preact component, shared by the dashboard and the simulation page.
// props: title, x ("time" for Unix seconds, or a label), series [{label, stroke}], data
// ([xs, ys1, ys2, ...]: uPlot's columns), testid.
import { html, useEffect, useRef } from './vendor/preact-htm.js';
import uPlot from './vendor/uPlot.esm.js';

export function Chart({ title, x = 'time', series, data, testid, height = 200 }) {
  const box = useRef(null);
  const plot = useRef(null);
  useEffect(() => {
    const width = Math.max(300, box.current.clientWidth || 420);
    const opts = {
      width, height,
      scales: { x: { time: x === 'time' } },
      axes: [{ label: x === 'time' ? '' : x }, {}],
      series: [{ label: x === 'time' ? 'time' : x }, ...series.map((s) => ({ spanGaps: false, width: 2, ...s }))],
    };
    plot.current = new uPlot(opts, data, box.current);
    return () => plot.current.destroy();
  }, [series.length]);
  useEffect(() => { if (plot.current) plot.current.setData(data); }, [data]);
  return html`<div class="chart" data-testid=${testid}><h3>${title}</h3><div ref=${box}></div></div>`;
}
