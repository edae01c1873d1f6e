/* The sandbox ("pause") process of the local node's pods: it holds the pod's namespaces and does nothing
 * else. PID 1 of its PID namespace, so it reaps orphans and must exit on SIGINT/SIGTERM itself (the kernel
 * does not apply default signal actions to a namespace's init). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) {
	(void)sig;
	_exit(0);
}

static void on_child(int sig) {
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

static void handle(int sig, void (*fn)(int)) {
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = fn;
	sa.sa_flags = SA_RESTART;
	sigemptyset(&sa.sa_mask);
	if (sigaction(sig, &sa, NULL) != 0) {
		perror("pause: sigaction");
		exit(1);
	}
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts("gpu-dra pause 1");
		return 0;
	}
	handle(SIGINT, on_term);
	handle(SIGTERM, on_term);
	handle(SIGCHLD, on_child);
	for (;;)
		pause();
	return 1;
}
