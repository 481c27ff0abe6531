"""The hidden-state server, in four parts:

- `handoff/`: what both ends share: request ids, the dump files in the handoff dir, the writer.
- `reference/`: the built-in reference server, a process of its own
  (`python -m eaglepipe.server.reference.server`).
- `sglang/`: the SGLang launch recipe and the project's SGLang plugin (the hook is patch/).
- `lifecycle/`: the job side: a server's identity, command, process group, leases, ports, the
  shared server's start, reuse and stop, and the watchdog its clients run."""
