"""Router: `mesh.generate` on every node. Pure cores `prefixes` (which instance holds how much of a prompt)
and `routing` (which instance to use); the shell `actor` keeps the views and forwards to the chosen runner."""
