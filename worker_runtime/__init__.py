"""What the prefill and decode workers share, and what crosses a process: the wire contract, the
registry client, the model loader and one worker shell."""
