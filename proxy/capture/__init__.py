"""What the proxy records: capture sessions and their registry (`session`), each call's prompt ids spliced or
rendered (`prompts`, `tito`, `local_render`), the capture graph and its branches (`graph`, `branches`), and the
durable logs with their recovery (`store`, `recovery`). It asks the engine side for renders; it never imports the
server or a dialect."""
