"""What a backend is: the Accelerator face, and its per-process (``strategy``) and
process-creation (``launch``) roles."""
