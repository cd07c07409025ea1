/*
 * The pod sandbox's process, for the e2e nodes' containerd (test support, never shipped).
 *
 * It holds the pod's namespaces open and does nothing else: it sleeps in pause(), reaps the
 * zombies re-parented to it (it is PID 1 of the pod's PID namespace when the pod shares one), and
 * exits 0 when asked to stop with SIGINT or SIGTERM. Built with `cc -static -O2` by
 * e2e/src/images.rs, so the image needs no C library.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
	(void)sig;
	_exit(0);
}

static void on_child(int sig) {
	(void)sig;
	int saved = errno;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
	errno = saved;
}

static int handle(int sig, void (*fn)(int), int flags) {
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = fn;
	sa.sa_flags = flags;
	sigemptyset(&sa.sa_mask);
	return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts("tessera-e2e pause");
		return 0;
	}
	if (getpid() != 1) {
		fputs("pause: warning: not PID 1, zombies of others are not reaped here\n", stderr);
	}
	if (handle(SIGINT, on_stop, 0) < 0 || handle(SIGTERM, on_stop, 0) < 0 ||
	    handle(SIGCHLD, on_child, SA_NOCLDSTOP | SA_RESTART) < 0) {
		perror("pause: sigaction");
		return 1;
	}
	for (;;) {
		pause();
	}
}
