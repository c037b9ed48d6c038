"""Exit codes, one meaning each: 0 clean (steps ran and nothing failed), 1 a violation or a
target's crash or hang found or reproduced, 2 unusable input or configuration (the message says
what and what is allowed), 3 an error of kvprop itself, 130 interrupted, 141 the reader of its
output went away (a closed pipe, as a shell reports a Unix tool that SIGPIPE ended)."""

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: `kvprop ... | head -1` ends quietly, as `yes | head -1` does
