"""The control plane: the zmq server and clients (``plane``), each inbound message routed to the side
that serves it (``routing``), and the switches a node or test adds (``hooks``)."""
