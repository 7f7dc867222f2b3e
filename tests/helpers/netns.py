"""Network namespaces joined to this one by veth pairs, addressed inside 127.0.0.0/8: the
production module (``ops/hosts.py``, what ``ceaseless up --hosts`` makes its hosts of),
under the names the tests used before it was promoted."""

from ops.hosts import Namespace, Netns, Unavailable

__all__ = ["Namespace", "Netns", "Unavailable"]
