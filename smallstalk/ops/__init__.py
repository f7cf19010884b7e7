"""Operator commands over a data directory, one module each (`smallstalk aof`, `replay`,
`job-history`, `backup`, `config dump`) and their shared formatting."""
