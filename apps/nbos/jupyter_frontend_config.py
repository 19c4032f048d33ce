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
import tornado.websocket as _nbos_websocket

_nbos_write_message = _nbos_websocket.WebSocketHandler.write_message


def _nbos_write_message_without_nagle(self, message, binary=False):
    if not getattr(self, "_nbos_nodelay", False) and self.ws_connection is not None:
        self.ws_connection.set_nodelay(True)
        self._nbos_nodelay = True
    return _nbos_write_message(self, message, binary)


_nbos_websocket.WebSocketHandler.write_message = _nbos_write_message_without_nagle

