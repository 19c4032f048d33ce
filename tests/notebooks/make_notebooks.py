"""Writes the differential test notebooks of this directory (run it after editing a cell).

    /usr/bin/python3 tests/notebooks/make_notebooks.py

Each notebook is executed by test_differential.py on nbos and on ipykernel and the outputs are
compared cell by cell, so every cell must be deterministic *on ipykernel*. In particular:
  * output that reaches fds 1/2 directly (os.write, subprocesses, C code) is read by a thread in
    ipykernel, so such cells sleep briefly to let it arrive before the next write or the end of
    the cell;
  * cells expected to fail carry the `raises-exception` tag so that nbclient goes on.

The replicated run (executor rotating every cell) may differ from ipykernel only where a cell
says so, for the documented unreplicable objects (generators, iterators, open files...):
  * `nbos-unreplicable`: the cell binds one; the executor reports it on stderr
    ("nbos: cannot replicate ...");
  * `nbos-not-replicated`: the cell uses one on another replica; it fails with
    NotReplicatedError, which names it.
"""

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent
RAISES = "raises-exception"
UNREPLICABLE = "nbos-unreplicable"
NOT_REPLICATED = "nbos-not-replicated"


def cell(source, *tags):
    c = new_code_cell(source.strip("\n"))
    if tags:
        c.metadata["tags"] = list(tags)
    return c


def write(name, title, cells):
    nb = new_notebook(cells=[new_markdown_cell(f"# {title}")] + cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    # Stable cell ids so that regenerating gives identical files.
    for i, c in enumerate(nb.cells):
        c["id"] = f"{name.replace('_', '-')}-{i:02d}"
    nbformat.validate(nb)
    with open(HERE / f"{name}.ipynb", "w", encoding="utf-8") as f:
        nbformat.write(nb, f)


write("plain_python", "Plain Python: values, printing, Out/_/In", [
    cell("x = 1\ny = 2\nx + y"),
    cell("for i in range(3):\n    print(i, i * i)"),
    cell("""
def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

[fib(i) for i in range(12)]
"""),
    cell("""
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

    def __add__(self, other):
        return Point(self.x + other.x, self.y + other.y)

Point(1, 2) + Point(3, 4)
"""),
    cell("""
import dataclasses

@dataclasses.dataclass
class Item:
    name: str
    qty: int = 0

Item('apple', 3)
"""),
    cell("print('before the value')\n42"),
    cell("x + y;"),
    cell("x * 10  # a comment after the value"),
    cell("Out[1], _, __, ___"),
    cell("_1 + _8"),
    cell("In[1]"),
    cell("_i"),
    cell("sorted(Out)"),
    cell("len(In), len(Out), get_ipython().execution_count"),
    cell("print('a')\nprint('b', end='')\nprint('c')\nprint('d', 'e', sep='-')"),
    cell("1\n2\n3"),
    cell("None"),
    cell("'a string', b'bytes', 3.5, 1 + 2j, True"),
    cell("{'b': 2, 'a': 1, 'c': [1, 2, {3, 4}]}"),
    cell("list(range(60))"),
    cell("{i: 'v' * i for i in range(12)}"),
    cell("(i for i in range(3))"),
    cell("print('héllo ✓ 日本語 🙂')\n'ünïcödé'"),
    cell("print(__name__)"),
    cell("""
import pickle
pickle.loads(pickle.dumps(Item('pear', 2)))
"""),
    cell("import inspect\nprint(inspect.getsource(fib))"),
    cell("del x\n'x' in dir(), 'y' in dir()"),
    cell("%precision 3\nimport math\nmath.pi"),
    cell("%precision\nmath.pi"),
    cell("""
import warnings
warnings.simplefilter('always')
warnings.warn('careful now')
'after warning'
"""),
    cell("""
import sys
print('out line')
print('err line', file=sys.stderr)
sys.stdout.write('written\\n')
"""),
    cell("print(1)\ndisplay('shown')\nprint(2)\n3"),
    cell("if True:\n    z = 5\nz"),
    cell("lambda_value = (lambda a, b=2: a * b)(4)\nlambda_value"),
    cell("async def co():\n    return 'awaited'\nawait co()"),
    cell("import sys\nsys.version_info[:2]"),
    cell("type(get_ipython()).__name__"),
    cell("help(len)"),
    cell("import logging\nlogging.warning('a logged warning')"),
    cell("""
class Noisy:
    # Warns when it is rebuilt from a pickle, as some libraries' objects do: the other replicas
    # rebuild it, and what they print must not reach any cell's output.
    def __setstate__(self, state):
        warnings.warn('rebuilt from a pickle')
        self.__dict__.update(state)

noisy = Noisy()
noisy.n = 1
"""),
    cell("noisy.n += 1\nnoisy.n"),
    cell("noisy.n"),
])


write("errors", "Errors and the cells after them", [
    cell("undefined_name", RAISES),
    cell("1 / 0", RAISES),
    cell("""
def inner(x):
    return 1 / x

def outer():
    return inner(0)

outer()
""", RAISES),
    cell("x = = 1", RAISES),
    cell("def f():\nreturn 1", RAISES),
    cell("print('after syntax errors')\n'still alive'"),
    cell("raise ValueError('custom message')", RAISES),
    cell("""
class MyError(Exception):
    pass

raise MyError('from a custom class')
""", RAISES),
    cell("""
try:
    {}['missing']
except KeyError as e:
    raise RuntimeError('outer failure') from e
""", RAISES),
    cell("""
try:
    [][1]
except IndexError:
    raise TypeError('during handling')
""", RAISES),
    cell("""
import sys
print('partial output')
print('to stderr', file=sys.stderr)
1 / 0
print('never printed')
""", RAISES),
    cell("assert 1 + 1 == 3, 'math is broken'", RAISES),
    cell("import nonexistent_module_xyz", RAISES),
    cell("raise KeyboardInterrupt", RAISES),
    cell("raise SystemExit(3)", RAISES),
    cell("'ok after SystemExit'"),
    cell("""
class BadRepr:
    def _repr_html_(self):
        raise ValueError('bad html repr')
    def __repr__(self):
        return 'BadRepr()'

BadRepr()
"""),
    cell("""
class BadPlain:
    def __repr__(self):
        raise ValueError('bad plain repr')

BadPlain()
"""),
    cell("%xmode Plain"),
    cell("outer()", RAISES),
    cell("%xmode Minimal"),
    cell("outer()", RAISES),
    cell("%xmode Context"),
    cell("int('not a number')", RAISES),
    cell("_, _i"),
    cell("print('last cell runs')"),
])


write("rich_display", "Rich display", [
    cell("""
from IPython.display import (HTML, JSON, SVG, Image, Javascript, Latex, Markdown, Math, Pretty,
                             clear_output, display, update_display)
import struct
import zlib

def png(width, height, rgb=(255, 0, 0)):
    def chunk(kind, data):
        return (struct.pack('>I', len(data)) + kind + data
                + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff))
    row = b'\\x00' + bytes(rgb) * width
    return (b'\\x89PNG\\r\\n\\x1a\\n'
            + chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 2, 0, 0, 0))
            + chunk(b'IDAT', zlib.compress(row * height))
            + chunk(b'IEND', b''))
"""),
    cell("display('text', 42, [1, 2])"),
    cell("display(HTML('<b>bold</b>'))"),
    cell("HTML('<i>italic result</i>')"),
    cell("display(Markdown('# Title\\n*emphasis*'))"),
    cell("display(JSON({'a': [1, 2, 3], 'b': {'c': None}}))"),
    cell("JSON(['x', 'y'], expanded=True)"),
    cell("display(Latex(r'$\\alpha + \\beta$'))\nMath(r'\\frac{1}{2}')"),
    cell("SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"10\">"
         "<rect width=\"10\" height=\"10\"/></svg>')"),
    cell("display(Javascript('console.log(1)'))"),
    cell("Image(data=png(4, 3))"),
    cell("display(Image(data=png(8, 2, (0, 255, 0)), width=40))"),
    cell("display(Pretty('pretty text'))"),
    cell("h = display(HTML('<p>version 1</p>'), display_id='disp-1')\nprint(type(h).__name__)"),
    cell("display(Markdown('second display of the same id'), display_id='disp-1')"),
    cell("update_display(HTML('<p>version 2</p>'), display_id='disp-1')"),
    cell("h.update(HTML('<p>version 3</p>'))\n'updated'"),
    cell("""
handle = display('first', display_id=True)
handle.update('second')
handle.display_id == handle.display_id and len(handle.display_id) > 0
"""),
    cell("print('gone')\nclear_output()\nprint('stays')"),
    cell("print('a')\nclear_output(wait=True)\nprint('b')\ndisplay(HTML('<b>after wait</b>'))"),
    cell("display(HTML('<p>x</p>'))\nclear_output()"),
    cell("""
class Rich:
    def _repr_html_(self):
        return '<table><tr><td>rich</td></tr></table>'
    def _repr_markdown_(self):
        return '**rich**'
    def _repr_json_(self):
        return {'rich': True}
    def _repr_latex_(self):
        return '$r$'
    def __repr__(self):
        return 'Rich()'

Rich()
"""),
    cell("display(Rich())"),
    cell("""
class Bundle:
    def _repr_mimebundle_(self, include=None, exclude=None):
        return {'text/plain': 'bundle', 'text/html': '<b>bundle</b>'}, {'text/html': {'k': 1}}

Bundle()
"""),
    cell("""
class PrettyOne:
    def _repr_pretty_(self, p, cycle):
        p.text('PrettyOne<' + 'x' * 5 + '>')

[PrettyOne(), PrettyOne()]
"""),
    cell("display({'text/plain': 'raw text', 'text/html': '<b>raw html</b>'}, raw=True)"),
    cell("display(HTML('<b>meta</b>'), metadata={'isolated': True})"),
    cell("display(Rich(), include=['text/plain', 'text/markdown'])"),
    cell("display(Rich(), exclude=['text/html'])"),
    cell("""
import numpy as np
np.arange(12).reshape(3, 4) / 7
"""),
    cell("""
import pandas as pd
df = pd.DataFrame({'a': [1, 2, 3], 'b': [0.5, 1.5, 2.5], 'c': ['x', 'y', 'z']})
df
"""),
    cell("display(df.describe())\ndf['a']"),
    cell("""
ip = get_ipython()
ip.display_formatter.formatters['text/plain'].for_type(complex, lambda v, p, cycle: p.text('C!'))
3 + 4j
"""),
])


_MPL_CELLS = [
    cell("import matplotlib\nimport matplotlib.pyplot as plt\nmatplotlib.get_backend()"),
    cell("plt.rcParams['figure.figsize'], plt.rcParams['figure.dpi']"),
    cell("plt.plot([1, 2, 3], [1, 4, 9])"),
    cell("fig, ax = plt.subplots(figsize=(3, 2))\nax.bar(['a', 'b'], [1, 2]);"),
    cell("plt.plot([3, 1, 2])\nplt.title('shown')\nplt.show()\nprint('after show')"),
    cell("fig"),
    cell("display(fig)\n'displayed'"),
    cell("plt.close('all')\nplt.get_fignums()"),
    cell("fig2 = plt.figure(figsize=(2, 2))\nplt.close(fig2)\n'closed figure is not shown'"),
    cell("plt.figure(figsize=(2, 1))\nplt.plot([0, 1])\nprint('text before the image')"),
    cell("%config InlineBackend.figure_format = 'retina'\nplt.figure(figsize=(2, 2))\n"
         "plt.plot([1, 0]);"),
    cell("%config InlineBackend.figure_format = 'png'\nplt.subplots(1, 2, figsize=(4, 2))"),
]

write("matplotlib_inline", "matplotlib with %matplotlib inline",
      [cell("%matplotlib inline")] + _MPL_CELLS)
write("matplotlib_default", "matplotlib without any magic (the kernel's default backend)",
      list(_MPL_CELLS))


write("magics", "Magics and shell escapes", [
    cell("%time sum(range(1000))"),
    cell("%timeit -n1 -r1 sum(range(100))"),
    cell("%%time\ntotal = sum(range(10))\ntotal"),
    cell("%%timeit -n1 -r1\nsum(range(10))"),
    cell("import os\nos.makedirs('subdir', exist_ok=True)\nopen('subdir/note.txt', 'w').close()\n"
         "%cd subdir"),
    cell("os.path.basename(os.getcwd())"),
    cell("%cd .."),
    cell("%pwd"),
    cell("%env NBOS_TEST_VAR=hello"),
    cell("%env NBOS_TEST_VAR"),
    cell("os.environ['NBOS_TEST_VAR']"),
    cell("!echo shell says hi"),
    cell("!echo $NBOS_TEST_VAR {1 + 1}"),
    cell("!echo to stderr >&2"),
    cell("listing = !ls -1 subdir\nlisting"),
    cell("!exit 3\n_exit_code"),
    cell("%%bash\necho from bash\necho bash err >&2"),
    cell("%%sh\nfor i in 1 2 3; do echo line $i; done"),
    cell("%%writefile mymod.py\ndef hello():\n    return 'hello from mymod'\n"),
    cell("import mymod\nmymod.hello()"),
    cell("%%writefile -a mymod.py\n\nVALUE = 7\n"),
    cell("import importlib\nimportlib.reload(mymod).VALUE"),
    cell("%%writefile myext.py\ndef load_ipython_extension(ip):\n"
         "    ip.register_magic_function(lambda line: 'echo:' + line, 'line', 'echo')\n"),
    cell("%load_ext myext"),
    cell("%echo some words"),
    cell("%load_ext autoreload\n%autoreload 2"),
    cell("%%writefile script.py\nimport sys\nprint('script name', __name__, sys.argv[1:])\n"
         "SCRIPT_RESULT = 99\n"),
    cell("%run script.py a b"),
    cell("SCRIPT_RESULT"),
    cell("%who"),
    cell("%who_ls"),
    cell("%who int"),
    cell("%%capture captured\nprint('captured stdout')\ndisplay('captured display')"),
    cell("captured.stdout, len(captured.outputs)"),
    cell("captured.show()"),
    cell("%%html\n<b>html magic</b>"),
    cell("%%markdown\n*markdown magic*"),
    cell("%%latex\n$x^2$"),
    cell("%%javascript\nconsole.log('js magic')"),
    cell("%history -n 1-3"),
    cell("%pdb off"),
    cell("%alias_magic tm time\n%tm 1 + 1"),
    # Magics that ipykernel adds to IPython's own (KernelMagics, the storemagic extension).
    cell("stored_value = 42\n%store stored_value"),
    cell("%autosave 0"),
    cell("%less mymod.py"),
    cell("print('to be cleared')\n%clear"),
    cell("len?"),
    cell("%pinfo mymod.hello"),
    cell("%reset -f\n%who"),
])


write("stdin", "input() without stdin support", [
    cell("input('name? ')", RAISES),
    cell("import getpass\ngetpass.getpass('password: ')", RAISES),
    cell("""
try:
    input()
except Exception as e:
    print(type(e).__name__, e)
"""),
    cell("'ok after input'"),
])


write("fd_output", "Output from C code, subprocesses and raw file descriptors", [
    cell("import ctypes, os, subprocess, sys, time"),
    cell("n = os.write(1, b'fd1 direct\\n')\ntime.sleep(0.5)\nn"),
    cell("os.write(2, b'fd2 direct\\n')\ntime.sleep(0.5)"),
    cell("rc = os.system('echo from system')\ntime.sleep(0.5)\nrc"),
    cell("os.system('echo system err >&2; exit 2')\ntime.sleep(0.5)"),
    cell("r = subprocess.run(['echo', 'from subprocess'])\ntime.sleep(0.5)\nr.returncode"),
    cell("subprocess.run('echo sub err >&2', shell=True)\ntime.sleep(0.5)"),
    cell("subprocess.check_output(['echo', 'captured'])"),
    cell("""
libc = ctypes.CDLL(None)
libc.puts(b'from libc puts')
libc.fflush(None)
time.sleep(0.5)
""", UNREPLICABLE),
    cell("""
print('py 1')
sys.stdout.flush()
time.sleep(0.5)
os.write(1, b'fd 2\\n')
time.sleep(0.5)
print('py 3')
"""),
    cell("""
print('out before display')
os.write(1, b'fd before display\\n')
time.sleep(0.5)
display('the display')
print('out after display')
"""),
    cell("os.write(1, 'é日本 ✓\\n'.encode())\ntime.sleep(0.5)"),
    cell("os.write(1, b'no newline')\ntime.sleep(0.5)"),
    cell("print('next cell')"),
    cell("for i in range(2000):\n    print(i)"),
    cell("print('to stdout')\nprint('to stderr', file=sys.stderr)"),
    cell("sys.stderr.write('stderr write\\n')\nsys.stdout.write('abc\\n')"),
    cell("""
os.system('echo fd then error')
time.sleep(0.5)
raise RuntimeError('boom')
""", RAISES),
    cell("'after'"),
])


write("torch_training", "A small seeded CPU training loop in torch", [
    cell("import torch\ntorch.manual_seed(0)\ntorch.get_num_threads()"),
    cell("torch.arange(6).reshape(2, 3)"),
    cell("""
X = torch.linspace(-1, 1, 32).unsqueeze(1)
Y = 3 * X + 0.5 + 0.1 * torch.randn(X.shape)
model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.MSELoss()
for step in range(20):
    opt.zero_grad()
    loss = loss_fn(model(X), Y)
    loss.backward()
    opt.step()
    if step % 5 == 0:
        print(f'step {step:2d} loss {loss.item():.4f}')
round(loss.item(), 3)
"""),
    cell("with torch.no_grad():\n    print(model(torch.tensor([[0.0], [1.0]])).round(decimals=2))"),
    cell("model"),
    cell("torch.ones(2) @ torch.ones(3)", RAISES),
    cell("torch.tensor([1.5, 2.5], requires_grad=True) * 2"),
])


write("workspace_files", "Files beside the notebook, written and read by later cells", [
    cell("""
import csv, os
with open('data.csv', 'w', newline='') as f:
    csv.writer(f).writerows([['a', 'b'], [1, 2], [3, 4], [5, 6]])
os.path.getsize('data.csv')
"""),
    cell("""
import pandas as pd
df = pd.read_csv('data.csv')
df['c'] = df.a * df.b
df.to_csv('out.csv', index=False)
df
"""),
    cell("print(open('out.csv').read())"),
    cell("import numpy as np\nnp.save('arr.npy', np.arange(6).reshape(2, 3))"),
    cell("np.load('arr.npy').sum(axis=0)"),
    cell("""
import torch
torch.manual_seed(1)
net = torch.nn.Linear(3, 2)
torch.save(net.state_dict(), 'ckpt.pt')
"""),
    cell("""
restored = torch.nn.Linear(3, 2)
restored.load_state_dict(torch.load('ckpt.pt'))
print([torch.equal(a, b) for a, b in zip(net.parameters(), restored.parameters())])
"""),
    cell("os.makedirs('sub', exist_ok=True)\n%cd sub"),
    cell("open('notes.txt', 'w').write('written in sub')"),
    cell("%cd ..\nprint(os.path.isdir('sub'), open('sub/notes.txt').read())"),
    cell("""
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([1, 2, 3])
fig.savefig('fig.png')
plt.close(fig)
"""),
    cell("os.path.getsize('fig.png') > 1000"),
    cell("""
import pathlib, tempfile
with tempfile.TemporaryDirectory() as tmp:
    scratch = pathlib.Path(tmp, 'x.txt')
    scratch.write_text('scratch space')
    print(scratch.read_text())
"""),
])


write("local_modules", "The notebook's own modules: imported, changed, edited, reloaded", [
    cell("""
%%writefile helpers.py
count = 0
def bump(k=1):
    global count
    count += k
    return count
def greet(name):
    return f'hello {name}'
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm2(self):
        return self.x ** 2 + self.y ** 2
"""),
    cell("import helpers\nfrom helpers import greet, Point\nprint(greet('nbos'), helpers.bump())"),
    cell("print(helpers.bump(2), helpers.count)"),
    cell("helpers.count = 100\np = Point(3, 4)\nprint(helpers.bump())"),
    cell("print(p.norm2(), isinstance(p, helpers.Point))"),
    cell("""
%%writefile helpers.py
count = 0
def bump(k=1):
    global count
    count += 10 * k
    return count
def greet(name):
    return f'hi {name}'
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm2(self):
        return abs(self.x) + abs(self.y)
"""),
    cell("print(greet('x'), helpers.greet('x'), helpers.bump(), p.norm2())"),
    cell("import importlib\nimportlib.reload(helpers)\nprint(helpers.greet('x'), greet('x'))"),
    cell("print(helpers.bump(), helpers.count, p.norm2(), Point(1, 1).norm2())"),
    cell("""
import os
os.makedirs('mypkg', exist_ok=True)
open('mypkg/__init__.py', 'w').write('from .core import area\\n')
open('mypkg/core.py', 'w').write('import math\\ndef area(r):\\n    return round(math.pi * r * r, 3)\\n')
"""),
    cell("from mypkg import area\nimport mypkg.core\nprint(area(2), mypkg.core.area(1))"),
    cell("print(mypkg.area(3), area is mypkg.core.area)"),
])


write("process_state", "Random streams and library settings set in one cell, used in the next", [
    cell("import random\nrandom.seed(7)\nrandom.random()"),
    cell("(random.random(), random.randint(0, 1000), random.gauss(0, 1))"),
    cell("import numpy as np\nnp.random.seed(7)\nnp.random.rand(3)"),
    cell("(np.random.randn(2), np.random.randint(100))"),
    cell("import torch\ntorch.manual_seed(0)\ntorch.rand(2)"),
    cell("(torch.rand(2), torch.initial_seed())"),
    cell("np.set_printoptions(precision=2, suppress=True)\nprint(np.array([1 / 3, 2 / 3, 1e-9]))"),
    cell("print(np.array([1 / 3, 2 / 3]))"),
    cell("""
import pandas as pd
pd.set_option('display.max_rows', 4)
pd.set_option('display.precision', 2)
"""),
    cell("pd.DataFrame({'x': np.arange(10) / 3})"),
    cell("import matplotlib\nmatplotlib.rcParams['lines.linewidth'] = 3.5"),
    cell("matplotlib.rcParams['lines.linewidth']"),
    cell("import logging\nlogging.getLogger('nbos.demo').setLevel(logging.ERROR)"),
    cell("""
demo = logging.getLogger('nbos.demo')
(demo.getEffectiveLevel(), demo.isEnabledFor(logging.WARNING),
 logging.getLogger('nbos.demo.child').getEffectiveLevel())
"""),
    cell("import warnings\nwarnings.filterwarnings('error', category=UserWarning)"),
    cell("warnings.warn('filtered into an error')", RAISES),
    cell("import sys\nsys.setrecursionlimit(2345)"),
    cell("sys.getrecursionlimit()"),
    cell("torch.set_num_threads(1)\ntorch.use_deterministic_algorithms(True)"),
    cell("(torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())"),
    cell("squares = (i * i for i in range(5))\nnext(squares)", UNREPLICABLE),
    cell("next(squares)", NOT_REPLICATED),
])
