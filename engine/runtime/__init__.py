"""The rank runtime: the client in the caller's process (client.py), the rank processes (rank.py), the shared-memory
bridge that tensors cross (bridge.py), the control channel's framing (protocol.py) and the job kinds (jobs.py)."""
