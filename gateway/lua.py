"""What the gateway's Lua scripts share: each one's clock. A script's last ARGV is "now" (a
test's clock), or '' for Redis's own ``TIME``, so every replica shares one clock."""

CLOCK = """
local function num(x) return string.format('%.17g', x) end
local now
if ARGV[#ARGV] ~= '' then
  now = tonumber(ARGV[#ARGV])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""
