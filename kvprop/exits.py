"""Exit codes, one meaning each: 0 clean (steps ran and nothing failed), 1 a violation or a
target's crash or hang found or reproduced, 2 unusable input or configuration (the message says
what and what is allowed), 3 an error of kvprop itself, 130 interrupted."""

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
