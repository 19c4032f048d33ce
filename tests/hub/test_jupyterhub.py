"""nbos behind a real JupyterHub (Debian's jupyterhub, npm's configurable-http-proxy): two Hub
users, alice and bob, each get a single-user Jupyter server that uses nbos through
`--gateway-url`, with the Hub API token the Hub gave that server as its gateway token. The gateway
(`--auth jupyterhub`) asks the Hub whose each token is: each user starts a kernel and runs a cell
through their own server, and neither sees the other's kernel."""

import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gateway"))
from cluster import (KernelSocket, SplitCluster, free_port, processes_under,  # noqa: E402
                     rest_call)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROXY = os.path.join(ROOT, ".cache", "npm", "node_modules", ".bin", "configurable-http-proxy")
SERVICE_TOKEN = "hub-test-service-token-0123456789"

HUB_CONFIG = """
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {proxy_port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.JupyterHub.db_url = "sqlite:///{work}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{work}/cookie_secret"
c.JupyterHub.authenticator_class = "jupyterhub.auth.DummyAuthenticator"
c.Authenticator.allowed_users = {{"alice", "bob"}}
c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = "{work}/home/{{username}}"
c.Spawner.cmd = ["/usr/bin/jupyterhub-singleuser"]
c.Spawner.args = ["--gateway-url={gateway_url}", "--GatewayClient.request_timeout=120",
                  "--allow-root"]
c.Spawner.environment = {{
    "JUPYTERHUB_SINGLEUSER_APP": "jupyter_server.serverapp.ServerApp",
    # The server's own Hub token is its token for the gateway too.
    "JUPYTER_GATEWAY_AUTH_TOKEN": lambda spawner: spawner.api_token,
}}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.JupyterHub.services = [{{"name": "nbos-test", "api_token": "{service_token}"}}]
c.JupyterHub.load_roles = [{{"name": "nbos-test", "services": ["nbos-test"],
                             "scopes": ["admin:users", "admin:servers", "tokens"]}}]
"""


def hub_api(url, method, path, body=None, token=SERVICE_TOKEN):
    return rest_call(url + "/hub/api", token, method, path, body)


def wait_until(what, check, timeout=120):
    deadline = time.time() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        assert time.time() < deadline, what
        time.sleep(0.5)


def start_hub(work, gateway_url, hub_port):
    proxy_port, proxy_api_port = free_port(), free_port()
    with open(os.path.join(work, "jupyterhub_config.py"), "w") as f:
        f.write(HUB_CONFIG.format(proxy_port=proxy_port, hub_port=hub_port, proxy=PROXY,
                                  proxy_api_port=proxy_api_port, work=work,
                                  gateway_url=gateway_url, service_token=SERVICE_TOKEN))
    log = open(os.path.join(work, "hub.log"), "w")
    hub = subprocess.Popen(["/usr/bin/jupyterhub", "-f", "jupyterhub_config.py"], cwd=work,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{proxy_port}"
    wait_until("the Hub did not start", lambda: hub_api(url, "GET", "/")[0] == 200, 60)
    return hub, url


def user_with_server(url, name):
    """Starts the server of `name` (a user the Hub's configuration allows, so it exists);
    returns the user's own API token."""
    status, token = hub_api(url, "POST", f"/users/{name}/tokens", {"note": "test"})
    assert status in (200, 201), token
    assert hub_api(url, "POST", f"/users/{name}/server", {})[0] in (201, 202)
    wait_until(f"{name}'s server did not start",
               lambda: hub_api(url, "GET", f"/users/{name}")[1]["servers"][""]["ready"])
    return token["token"]


def stop_process_group(proc):
    """The Hub first asked to stop (it stops its users' servers and its proxy), then killed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue


def test_two_hub_users_run_cells_through_nbos_and_see_only_their_own_kernels():
    work = tempfile.mkdtemp(prefix="nbos-hub-")
    hub_port = free_port()
    c = SplitCluster(hosts=3, gateway_args=(
        "--auth", "jupyterhub", "--hub-api-url", f"http://127.0.0.1:{hub_port}/hub/api"))
    hub = None
    try:
        hub, url = start_hub(work, c.url, hub_port)
        tokens = {name: user_with_server(url, name) for name in ("alice", "bob")}
        kernels = {}
        for name, token in tokens.items():
            base = f"{url}/user/{name}"
            status, model = rest_call(base, token, "POST", "/api/kernels", {"name": "nbos"})
            assert status == 201, (name, status, model)
            kernels[name] = model["id"]
            ks = KernelSocket(base, model["id"], token)
            reply, iopub = ks.execute(f"print('hello from {name}')")
            assert reply["content"]["status"] == "ok", reply["content"]
            text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
            assert text == f"hello from {name}\n", text
            ks.close()
        for name, token in tokens.items():
            other = "bob" if name == "alice" else "alice"
            status, listed = rest_call(f"{url}/user/{name}", token, "GET", "/api/kernels")
            assert status == 200 and [k["id"] for k in listed] == [kernels[name]], listed
            status, _ = rest_call(f"{url}/user/{name}", token, "GET",
                                  f"/api/kernels/{kernels[other]}")
            assert status == 404, (name, status)
        # The gateway's admin sees both kernels, owned by the Hub's users.
        view = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")[1]
        owners = {k["id"]: k["owner"] for k in view["kernels"]}
        assert owners == {kernels["alice"]: "alice", kernels["bob"]: "bob"}, owners
        # A token the Hub does not know is refused by the gateway.
        assert rest_call(c.url, "not-a-hub-token", "GET", "/api/kernels")[0] == 403
    finally:
        if hub is not None:
            stop_process_group(hub)
        c.close()
        for pid, _ in processes_under(work):
            os.kill(pid, signal.SIGKILL)
    assert not processes_under(work)
