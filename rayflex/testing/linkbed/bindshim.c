/* Preloaded into every process of an emulated node (LD_PRELOAD), with the node's address in
 * LINKBED_NODE_IP:
 *   - a TCP connection to a loopback address leaves from the node's address, not from
 *     127.0.0.1 (the kernel's choice for an unbound socket), so tc can tell which node sent
 *     each packet;
 *   - the host's name is the node's address, as a real node's name resolves to its own
 *     address (gloo binds its listener to whatever the host name resolves to);
 *   - nothing outside loopback is ever a target: such a connect fails with ENETUNREACH
 *     before the kernel sees it (Ray probes 8.8.8.8 to learn its own address; the private
 *     namespace has no route there either, this makes it explicit).
 * Without LINKBED_NODE_IP both calls behave as libc's. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <stdlib.h>

static int unbound_stream(int fd, int family) {
    int type = 0;
    socklen_t tl = sizeof type;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) return 0;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 || ss.ss_family != family) return 0;
    if (family == AF_INET) return ((struct sockaddr_in *)&ss)->sin_port == 0;
    return ((struct sockaddr_in6 *)&ss)->sin6_port == 0;
}

static void bind_to_node(int fd, const struct sockaddr *to, const char *ip) {
    if (to->sa_family == AF_INET) {
        const struct sockaddr_in *dst = (const struct sockaddr_in *)to;
        if ((ntohl(dst->sin_addr.s_addr) >> 24) != 127 || !unbound_stream(fd, AF_INET)) return;
        struct sockaddr_in me;
        memset(&me, 0, sizeof me);
        me.sin_family = AF_INET;
        if (inet_pton(AF_INET, ip, &me.sin_addr) == 1) bind(fd, (struct sockaddr *)&me, sizeof me);
    } else if (to->sa_family == AF_INET6) {
        const struct sockaddr_in6 *dst = (const struct sockaddr_in6 *)to;
        if (!IN6_IS_ADDR_V4MAPPED(&dst->sin6_addr) || dst->sin6_addr.s6_addr[12] != 127) return;
        if (!unbound_stream(fd, AF_INET6)) return;
        struct sockaddr_in6 me;
        char mapped[64];
        memset(&me, 0, sizeof me);
        me.sin6_family = AF_INET6;
        snprintf(mapped, sizeof mapped, "::ffff:%s", ip);
        if (inet_pton(AF_INET6, mapped, &me.sin6_addr) == 1) bind(fd, (struct sockaddr *)&me, sizeof me);
    }
}

static int outside_loopback(const struct sockaddr *to) {
    if (to->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)to)->sin_addr.s_addr) >> 24) != 127;
    if (to->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)to)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return 0;
        return !IN6_IS_ADDR_V4MAPPED(a) || a->s6_addr[12] != 127;
    }
    return 0;  /* unix sockets, AF_UNSPEC (a datagram socket's disconnect) */
}

int connect(int fd, const struct sockaddr *to, socklen_t len) {
    typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);
    static connect_fn real = 0;
    if (!real) real = (connect_fn)dlsym(RTLD_NEXT, "connect");
    const char *ip = getenv("LINKBED_NODE_IP");
    if (ip && to && outside_loopback(to)) {
        errno = ENETUNREACH;
        return -1;
    }
    if (ip && to) {
        int saved = errno;
        bind_to_node(fd, to, ip);  /* a failed bind leaves the socket as it was */
        errno = saved;
    }
    return real(fd, to, len);
}

int gethostname(char *name, size_t len) {
    typedef int (*gethostname_fn)(char *, size_t);
    static gethostname_fn real = 0;
    const char *ip = getenv("LINKBED_NODE_IP");
    if (!ip) {
        if (!real) real = (gethostname_fn)dlsym(RTLD_NEXT, "gethostname");
        return real(name, len);
    }
    if (strlen(ip) + 1 > len) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(name, ip);
    return 0;
}
