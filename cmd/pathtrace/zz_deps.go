package main

import (
	_ "github.com/cilium/ebpf"
	_ "github.com/google/nftables"
	_ "github.com/gopacket/gopacket"
	_ "github.com/gopacket/gopacket/pcapgo"
	_ "github.com/spf13/pflag"
	_ "github.com/ti-mo/conntrack"
	_ "github.com/vishvananda/netlink"
	_ "github.com/vishvananda/netns"
	_ "golang.org/x/net/bpf"
	_ "golang.org/x/sys/unix"
)
