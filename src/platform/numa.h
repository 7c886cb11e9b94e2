// NUMA nodes and memory policies: which nodes this process may allocate from, how much is free
// on each, placing a mapping's pages (mbind, set_mempolicy), and reading back where they are
// (numa_maps). Raw system calls: no libnuma.
//
// Container runtimes' default seccomp profiles (Docker's, Podman's) allow mbind, set_mempolicy
// and get_mempolicy only with CAP_SYS_NICE: the calls then fail with EPERM, which the caller
// reports (see docs/numa.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// "0-3,8,10-11" (the kernel's list format) to {0,1,2,3,8,10,11}; an empty string is no node.
// kInvalidArgument naming the text when it is not such a list (or names a node past 4095).
Result<std::vector<int>> ParseNodeList(std::string_view text);
// {0,1,2,5} -> "0-2,5".
std::string FormatNodeList(const std::vector<int>& nodes);

// Nodes that have memory (/sys/devices/system/node/has_memory, else "online"); {0} where the
// kernel has no NUMA (no /sys/devices/system/node).
std::vector<int> MemoryNodes();
// The nodes this process may allocate from: its cpuset's mems (Mems_allowed_list of
// /proc/self/status) that have memory; MemoryNodes() when the field is absent.
std::vector<int> AllowedMemoryNodes();

// free_hugepages of /sys/devices/system/node/nodeN/hugepages/hugepages-<page_bytes/1024>kB.
Result<uint64_t> NodeFreeHugePages(int node, uint64_t page_bytes);

// The node whose CPUs hold most of this thread's CPU affinity; -1 when unknown.
int NodeOfCurrentCpus();
// The memory nodes holding at least one CPU of this thread's affinity, ascending (one node for
// a process pinned to a socket, every node for one that is not); empty when unknown.
std::vector<int> NodesOfCurrentCpus();
// numa_node of a PCI device (/sys/bus/pci/devices/<bus_id>/numa_node, e.g. "0000:3b:00.0");
// -1 when the file is absent or says -1 (a one-node host).
int NodeOfPciDevice(const std::string& bus_id);

enum class MemPolicy { kDefault, kBind, kInterleave };

// mbind(2) of [start, start+length) to `nodes` (page-aligned). On tmpfs this is the file's
// shared policy for that range: every page allocated for it later, by any process, fallocate
// included, follows it. On other mappings (hugetlbfs, anonymous) it is the mapping's own policy.
Status BindRange(void* start, uint64_t length, MemPolicy policy, const std::vector<int>& nodes,
                 const std::string& what);
// set_mempolicy(2) of the calling thread (what allocations without a mapping's policy follow,
// e.g. fallocate on hugetlbfs), keeping the policy it had (an engine started under numactl has
// one) for RestoreThreadPolicy, which puts it back. Not nested.
Status SetThreadPolicy(MemPolicy policy, const std::vector<int>& nodes, const std::string& what);
Status RestoreThreadPolicy(const std::string& what);

// Bytes of the mapping that starts at `start` on each node, from /proc/self/numa_maps (pages
// this process has mapped: after populate, all of them). Empty when the kernel has no numa_maps.
Result<std::map<int, uint64_t>> MappingBytesPerNode(const void* start);
// MappingBytesPerNode summed over the mappings that start at each of `starts`, from one read
// of /proc/self/numa_maps; a start without a line adds nothing. Empty without numa_maps.
std::map<int, uint64_t> MappingsBytesPerNode(const std::vector<const void*>& starts);
// One numa_maps line's "N<node>=<pages>" fields times its kernelpagesize_kB (pure, for tests).
std::map<int, uint64_t> ParseNumaMapsLine(std::string_view line);

}  // namespace expert_arena::platform
