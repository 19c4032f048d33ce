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
#
# jupyter server 1.x opens its WebSocket to the gateway in a callback scheduled after the
# client's socket opens, and until then queues a client's message on a placeholder future that
# nothing ever completes. A message that arrives first (a client that sends kernel_info_request
# as soon as its socket opens, as JupyterLab's does, on a busy machine) was lost, and the client
# waited for its reply forever. Such messages now wait for the real connection. Notebook 6
# connects at once and is unaffected.
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


def _nbos_hold_early_messages(client):
    connect, on_message = client._connect, client.on_message

    def on_message_once_connecting(self, message):
        if self.ws is None and not getattr(self, "_nbos_connecting", False):
            self.__dict__.setdefault("_nbos_early", []).append(message)
            return
        on_message(self, message)

    async def connect_then_send_early(self, *args, **kwargs):
        await connect(self, *args, **kwargs)
        self._nbos_connecting = True
        for message in self.__dict__.pop("_nbos_early", []):
            on_message(self, message)

    client.on_message = on_message_once_connecting
    client._connect = connect_then_send_early


try:
    from jupyter_server.gateway.handlers import GatewayWebSocketClient as _nbos_client
except ImportError:
    pass
else:
    import inspect as _nbos_inspect

    if _nbos_inspect.iscoroutinefunction(_nbos_client._connect):
        _nbos_hold_early_messages(_nbos_client)
