# Jupyter configuration that `nbos up --frontend` writes for its front end (and that
# bench/gateway_bench.py --server-nodelay gives the jupyter servers it measures).
#
# Tornado leaves Nagle's algorithm on for WebSocket streams (its HTTP/1 connection turns
# TCP_NODELAY off again once the upgrade's response is written), and Jupyter's kernel WebSocket
# handlers do not turn it on. A cell's messages then leave as a burst of small writes: the first
# goes out, the rest wait for the browser's ACK of it, which Linux delays by up to 40 ms. Every
# cell paid that stall whatever the kernel. Each WebSocket is set TCP_NODELAY before its first
# message instead (as tornado's documentation suggests for latency-sensitive sockets). The
# WebSocket to the gateway carries one message per cell and is left as it is.
#
# With --gateway-url, jupyter server's and Notebook 6's kernel WebSocket handler turn on
# permessage-deflate for every client that offers it (browsers and JupyterLab's client under
# Node do), while the handler for local kernels compresses only when the
# websocket_compression_options setting asks for it. Every message of a cell was then deflated
# in the server's Python thread and inflated by the client: about 2 ms of a `pass` cell on the
# client's side alone. The gateway's handler follows that setting here as the local one does.
import tornado.websocket as _nbos_websocket

_nbos_write_message = _nbos_websocket.WebSocketHandler.write_message


def _nbos_write_message_without_nagle(self, message, binary=False):
    if not getattr(self, "_nbos_nodelay", False) and self.ws_connection is not None:
        self.ws_connection.set_nodelay(True)
        self._nbos_nodelay = True
    return _nbos_write_message(self, message, binary)


_nbos_websocket.WebSocketHandler.write_message = _nbos_write_message_without_nagle


def _nbos_compression_as_configured(self):
    return self.settings.get("websocket_compression_options", None)


for _nbos_module in ("jupyter_server.gateway.handlers", "notebook.gateway.handlers"):
    try:
        _nbos_handlers = __import__(_nbos_module, fromlist=["WebSocketChannelsHandler"])
    except ImportError:
        continue
    _nbos_handlers.WebSocketChannelsHandler.get_compression_options = (
        _nbos_compression_as_configured)
